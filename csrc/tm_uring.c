/* See tm_uring.h: data-only helpers over liburing; negative errno on failure, no policy. */
#include "tm_uring.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

#include <liburing.h>

struct tm_ring {
    struct io_uring ring;
};

int tm_ring_open(unsigned entries, int sqpoll, unsigned sq_idle_ms, struct tm_ring **out)
{
    struct io_uring_params params;
    struct tm_ring *r;
    int ret;

    *out = NULL;
    r = calloc(1, sizeof(*r));
    if (!r)
        return -ENOMEM;
    memset(&params, 0, sizeof(params));
    if (sqpoll) {
        params.flags |= IORING_SETUP_SQPOLL;
        params.sq_thread_idle = sq_idle_ms;
    }
    ret = io_uring_queue_init_params(entries, &r->ring, &params);
    if (ret < 0) {
        free(r);
        return ret;
    }
    *out = r;
    return 0;
}

void tm_ring_close(struct tm_ring *r)
{
    if (!r)
        return;
    io_uring_queue_exit(&r->ring);
    free(r);
}

unsigned tm_ring_sq_entries(struct tm_ring *r)
{
    return r->ring.sq.ring_entries;
}

unsigned tm_ring_features(struct tm_ring *r)
{
    return r->ring.features;
}

int tm_ring_register_buffers(struct tm_ring *r, const uint64_t *addrs, const uint64_t *lens, unsigned n)
{
    struct iovec *iov;
    unsigned i;
    int ret;

    iov = calloc(n ? n : 1, sizeof(*iov));
    if (!iov)
        return -ENOMEM;
    for (i = 0; i < n; i++) {
        iov[i].iov_base = (void *)(uintptr_t)addrs[i];
        iov[i].iov_len = (size_t)lens[i];
    }
    ret = io_uring_register_buffers(&r->ring, iov, n);
    free(iov);
    return ret;
}

int tm_ring_unregister_buffers(struct tm_ring *r)
{
    return io_uring_unregister_buffers(&r->ring);
}

/* Queue up to `n` requests and submit them with one system call; returns how many were queued
 * (fewer than `n` only when the submission queue is full, e.g. while an SQPOLL thread lags). */
int tm_ring_submit(struct tm_ring *r, const struct tm_req *reqs, unsigned n)
{
    unsigned i;
    int ret;

    for (i = 0; i < n; i++) {
        const struct tm_req *q = &reqs[i];
        struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
        void *buf = (void *)(uintptr_t)q->addr;

        if (!sqe)
            break;
        switch (q->op) {
        case TM_OP_READ:
            if (q->buf_index >= 0)
                io_uring_prep_read_fixed(sqe, q->fd, buf, q->len, q->offset, q->buf_index);
            else
                io_uring_prep_read(sqe, q->fd, buf, q->len, q->offset);
            break;
        case TM_OP_WRITE:
            if (q->buf_index >= 0)
                io_uring_prep_write_fixed(sqe, q->fd, buf, q->len, q->offset, q->buf_index);
            else
                io_uring_prep_write(sqe, q->fd, buf, q->len, q->offset);
            break;
        case TM_OP_NOP:
            io_uring_prep_nop(sqe);
            break;
        default:
            return -EINVAL;
        }
        io_uring_sqe_set_data64(sqe, q->user_data);
    }
    do {
        ret = io_uring_submit(&r->ring);
    } while (ret == -EINTR);
    if (ret < 0)
        return ret;
    return (int)i;
}

/* Wait for `wait_nr` completions (0: do not block), then drain up to `max` of them into `out`. */
int tm_ring_reap(struct tm_ring *r, struct tm_cqe *out, unsigned max, unsigned wait_nr)
{
    struct io_uring_cqe *cqe;
    unsigned n = 0, head;
    int ret;

    if (wait_nr) {
        do {
            ret = io_uring_wait_cqe_nr(&r->ring, &cqe, wait_nr);
        } while (ret == -EINTR);
        if (ret < 0 && ret != -EAGAIN)
            return ret;
    }
    io_uring_for_each_cqe(&r->ring, head, cqe) {
        if (n == max)
            break;
        out[n].user_data = io_uring_cqe_get_data64(cqe);
        out[n].res = cqe->res;
        out[n].flags = cqe->flags;
        n++;
    }
    io_uring_cq_advance(&r->ring, n);
    return (int)n;
}

/* Open and close a tiny ring to tell whether this kernel and process may use io_uring at all. */
int tm_ring_probe(void)
{
    struct io_uring ring;
    int ret = io_uring_queue_init(2, &ring, 0);

    if (ret < 0)
        return ret;
    io_uring_queue_exit(&ring);
    return 0;
}
