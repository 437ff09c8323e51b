/* See tm_uring.h: the transfer pipeline over liburing; negative errno on failure. */
#define _GNU_SOURCE
#include "tm_uring.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <liburing.h>

#define WAKE_ID UINT64_MAX /* user_data of the eventfd read that wakes a sleeping loop */

struct request;

/* A piece inside the core; it lives in its request's allocation. */
struct node {
    struct tm_xfer x;
    struct request *req;
    uint32_t index;       /* its place in the request, for tm_done.err_index */
    uint64_t issued;      /* bytes handed to chunks so far */
    unsigned outstanding; /* chunks handed out and not finished */
    struct node *next;
};

/* A request: its pieces, reported together once the last one has finished. One allocation. */
struct request {
    uint64_t user_data;
    unsigned left; /* pieces neither finished nor dropped; the request is freed at 0 */
    int32_t err;   /* first failure, 0 while none */
    uint32_t err_index;
    uint64_t err_offset, err_len;
    struct node nodes[];
};

/* A chunk in the ring (or waiting to be resubmitted); its index is the SQE's user_data. */
struct slot {
    struct node *n;
    uint64_t addr, offset;
    uint32_t len;
};

struct tm_engine {
    struct io_uring ring;
    pthread_mutex_t lock;
    /* shared with the threads that enqueue; under `lock` */
    struct node *head, *tail; /* pieces with bytes not yet handed to a chunk, in arrival order */
    int sleeping, kicked, stopping;
    unsigned used; /* slots holding a chunk; atomic, read by callers to decide whether to wake */
    /* the loop thread's own */
    struct slot *slots;
    unsigned *free_ids, nfree;
    unsigned *retry, nretry; /* slots to resubmit: short transfers, -EAGAIN, -EINTR */
    unsigned qd;
    uint32_t block;
    int sqpoll;
    int disabled; /* created disabled: tm_engine_start must enable it */
    int wake_fd, wake_armed;
    uint64_t wake_buf;
    uint64_t (*fixed)[2]; /* [start, end) of each registered buffer, by index */
    unsigned nfixed;
    struct tm_done *done; /* finished requests not yet returned by tm_engine_run */
    unsigned ndone, done_cap;
    uint64_t stats[TM_NSTATS];
};

/* Drop the pieces still queued at close; a request goes when its last piece does. */
static void free_nodes(struct node *n)
{
    struct node *next;

    for (; n; n = next) {
        next = n->next;
        if (--n->req->left == 0)
            free(n->req);
    }
}

/* Everything but the ring and the mutex: what both a failed open and close give back. */
static void free_engine(struct tm_engine *e)
{
    if (e->wake_fd >= 0)
        close(e->wake_fd);
    free_nodes(e->head);
    free(e->fixed);
    free(e->slots);
    free(e->free_ids);
    free(e->retry);
    free(e->done);
    free(e);
}

int tm_engine_open(unsigned queue_depth, uint32_t block_size, int sqpoll, unsigned sq_idle_ms,
                   struct tm_engine **out)
{
    struct io_uring_params params;
    struct tm_engine *e;
    unsigned i;
    int ret;

    *out = NULL;
    if (!queue_depth || !block_size)
        return -EINVAL;
    e = calloc(1, sizeof(*e));
    if (!e)
        return -ENOMEM;
    e->qd = queue_depth;
    e->block = block_size;
    e->sqpoll = sqpoll;
    e->done_cap = 2 * (queue_depth + 1);
    e->slots = calloc(queue_depth, sizeof(*e->slots));
    e->free_ids = calloc(queue_depth, sizeof(*e->free_ids));
    e->retry = calloc(queue_depth, sizeof(*e->retry));
    e->done = calloc(e->done_cap, sizeof(*e->done));
    e->wake_fd = eventfd(0, EFD_CLOEXEC);
    if (!e->slots || !e->free_ids || !e->retry || !e->done || e->wake_fd < 0) {
        ret = e->wake_fd < 0 ? -errno : -ENOMEM;
        goto fail;
    }
    for (i = 0; i < queue_depth; i++)
        e->free_ids[i] = queue_depth - 1 - i;
    e->nfree = queue_depth;
    /* queue_depth chunks plus the wake read; the CQ is twice that, so it cannot overflow */
    if (sqpoll) {
        memset(&params, 0, sizeof(params));
        params.flags = IORING_SETUP_SQPOLL;
        params.sq_thread_idle = sq_idle_ms;
        ret = io_uring_queue_init_params(queue_depth + 1, &e->ring, &params);
    } else {
        /* Only the loop's thread submits and waits, so completion work can wait until it asks for
         * completions (DEFER_TASKRUN) instead of interrupting it for each one. The ring starts disabled
         * and tm_engine_start enables it on the loop's thread, which makes that thread its one issuer.
         * Kernels before 6.1 refuse these flags; then the ring is a plain one. */
        memset(&params, 0, sizeof(params));
        params.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_R_DISABLED;
        ret = io_uring_queue_init_params(queue_depth + 1, &e->ring, &params);
        if (ret == -EINVAL) {
            memset(&params, 0, sizeof(params));
            ret = io_uring_queue_init_params(queue_depth + 1, &e->ring, &params);
        } else if (ret == 0) {
            e->disabled = 1;
        }
    }
    if (ret < 0)
        goto fail;
    pthread_mutex_init(&e->lock, NULL);
    *out = e;
    return 0;
fail:
    free_engine(e);
    return ret;
}

void tm_engine_close(struct tm_engine *e)
{
    if (!e)
        return;
    io_uring_queue_exit(&e->ring);
    pthread_mutex_destroy(&e->lock);
    free_engine(e);
}

static unsigned used_now(struct tm_engine *e)
{
    return __atomic_load_n(&e->used, __ATOMIC_RELAXED);
}

/* Called first on the loop's thread: enable a ring created disabled (making this thread its issuer) and
 * register the ring's descriptor with this thread, which spares a descriptor lookup per system call. */
int tm_engine_start(struct tm_engine *e)
{
    int ret;

    if (e->disabled) {
        /* the system call itself: io_uring_enable_rings is missing from some liburing builds (Debian's 2.3) */
        ret = (int)syscall(__NR_io_uring_register, e->ring.ring_fd, IORING_REGISTER_ENABLE_RINGS, NULL, 0);
        if (ret < 0)
            return -errno;
        e->disabled = 0;
    }
    io_uring_register_ring_fd(&e->ring); /* an optimisation: its failure changes nothing else */
    return 0;
}

/* Queue one request of n pieces from any thread. The loop is woken only when it sleeps on a ring under
 * half full: with more in flight, its next completions wake it soon enough, and a wake costs a system
 * call and two context switches. */
int tm_engine_enqueue(struct tm_engine *e, uint64_t user_data, const struct tm_xfer *xfers, unsigned n)
{
    struct request *r;
    unsigned i, half = e->qd / 2 ? e->qd / 2 : 1;
    int wake;

    if (!n)
        return -EINVAL;
    for (i = 0; i < n; i++)
        if (!xfers[i].len)
            return -EINVAL; /* a piece that moves nothing would never finish */
    r = calloc(1, sizeof(*r) + n * sizeof(r->nodes[0]));
    if (!r)
        return -ENOMEM;
    r->user_data = user_data;
    r->left = n;
    for (i = 0; i < n; i++) {
        r->nodes[i].x = xfers[i];
        r->nodes[i].req = r;
        r->nodes[i].index = i;
        r->nodes[i].next = i + 1 < n ? &r->nodes[i + 1] : NULL;
    }
    pthread_mutex_lock(&e->lock);
    if (e->stopping) {
        pthread_mutex_unlock(&e->lock);
        free(r);
        return -ESHUTDOWN;
    }
    if (e->tail)
        e->tail->next = &r->nodes[0];
    else
        e->head = &r->nodes[0];
    e->tail = &r->nodes[n - 1];
    wake = e->sleeping && used_now(e) < half;
    if (wake)
        e->sleeping = 0;
    pthread_mutex_unlock(&e->lock);
    if (wake)
        eventfd_write(e->wake_fd, 1);
    return 0;
}

/* Make tm_engine_run return: with stop, once everything queued has finished; else at its next wake-up,
 * which is at once on a ring under half full and after the next few completions on a fuller one. */
void tm_engine_kick(struct tm_engine *e, int stop)
{
    int wake;

    pthread_mutex_lock(&e->lock);
    if (stop)
        e->stopping = 1;
    else
        e->kicked = 1;
    wake = e->sleeping;
    e->sleeping = 0;
    pthread_mutex_unlock(&e->lock);
    if (wake)
        eventfd_write(e->wake_fd, 1);
}

/* Called on the loop's thread only (between tm_engine_run calls). */
int tm_engine_register_buffers(struct tm_engine *e, const uint64_t *addrs, const uint64_t *lens, unsigned n)
{
    struct iovec *iov;
    uint64_t (*fixed)[2];
    unsigned i;
    int ret;

    if (e->nfixed) {
        ret = io_uring_unregister_buffers(&e->ring);
        if (ret < 0)
            return ret;
        free(e->fixed);
        e->fixed = NULL;
        e->nfixed = 0;
    }
    iov = calloc(n ? n : 1, sizeof(*iov));
    fixed = calloc(n ? n : 1, sizeof(*fixed));
    if (!iov || !fixed) {
        free(iov);
        free(fixed);
        return -ENOMEM;
    }
    for (i = 0; i < n; i++) {
        iov[i].iov_base = (void *)(uintptr_t)addrs[i];
        iov[i].iov_len = (size_t)lens[i];
        fixed[i][0] = addrs[i];
        fixed[i][1] = addrs[i] + lens[i];
    }
    ret = io_uring_register_buffers(&e->ring, iov, n);
    free(iov);
    if (ret < 0) {
        free(fixed);
        return ret;
    }
    e->fixed = fixed;
    e->nfixed = n;
    return 0;
}

/* Read the counters (tm_uring.h: TM_STAT_*); the loop's thread writes them, so they are approximate
 * while it runs. */
void tm_engine_stats(struct tm_engine *e, uint64_t *out)
{
    memcpy(out, e->stats, sizeof(e->stats));
}

static struct io_uring_sqe *get_sqe(struct tm_engine *e)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&e->ring);

    /* Only an SQPOLL ring can be full here (its kernel thread has not taken the last batch yet). */
    while (!sqe && e->sqpoll) {
        io_uring_submit(&e->ring);
        io_uring_sqring_wait(&e->ring);
        sqe = io_uring_get_sqe(&e->ring);
    }
    return sqe;
}

static int fixed_index(const struct tm_engine *e, uint64_t addr, uint64_t len)
{
    unsigned i;

    for (i = 0; i < e->nfixed; i++)
        if (addr >= e->fixed[i][0] && addr + len <= e->fixed[i][1])
            return (int)i;
    return -1;
}

static int prep_chunk(struct tm_engine *e, unsigned id)
{
    const struct slot *s = &e->slots[id];
    const struct tm_xfer *x = &s->n->x;
    struct io_uring_sqe *sqe = get_sqe(e);
    void *buf = (void *)(uintptr_t)s->addr;
    int fd = x->fd, index;

    if (!sqe)
        return -EBUSY;
    if (x->align && ((s->addr | s->offset | s->len) & (x->align - 1)))
        fd = x->buffered_fd;
    index = e->nfixed ? fixed_index(e, s->addr, s->len) : -1;
    e->stats[TM_STAT_CHUNKS]++;
    if (index >= 0)
        e->stats[TM_STAT_FIXED]++;
    if (x->op == TM_OP_READ) {
        if (index >= 0)
            io_uring_prep_read_fixed(sqe, fd, buf, s->len, s->offset, index);
        else
            io_uring_prep_read(sqe, fd, buf, s->len, s->offset);
    } else {
        if (index >= 0)
            io_uring_prep_write_fixed(sqe, fd, buf, s->len, s->offset, index);
        else
            io_uring_prep_write(sqe, fd, buf, s->len, s->offset);
    }
    io_uring_sqe_set_data64(sqe, id);
    return 0;
}

static int finish_chunk(struct tm_engine *e, unsigned id, int32_t err);

/* Put the wake read, resubmissions and new chunks (up to the queue depth) in the ring; one submit. */
static int fill(struct tm_engine *e)
{
    struct io_uring_sqe *sqe;
    unsigned queued = 0, id;
    struct node *n;
    uint64_t rest;
    int ret = 0;

    if (!e->wake_armed) {
        sqe = get_sqe(e);
        if (!sqe)
            return -EBUSY;
        io_uring_prep_read(sqe, e->wake_fd, &e->wake_buf, sizeof(e->wake_buf), 0);
        io_uring_sqe_set_data64(sqe, WAKE_ID);
        e->wake_armed = 1;
        queued++;
    }
    while (e->nretry) {
        ret = prep_chunk(e, e->retry[--e->nretry]);
        if (ret < 0)
            return ret;
        queued++;
    }
    pthread_mutex_lock(&e->lock);
    while (e->nfree && e->head) {
        n = e->head;
        id = e->free_ids[--e->nfree];
        rest = n->x.len - n->issued;
        e->slots[id].n = n;
        e->slots[id].addr = n->x.addr + n->issued;
        e->slots[id].offset = n->x.offset + n->issued;
        e->slots[id].len = rest < e->block ? (uint32_t)rest : e->block;
        n->issued += e->slots[id].len;
        n->outstanding++;
        if (n->issued == n->x.len) {
            e->head = n->next;
            if (!e->head)
                e->tail = NULL;
        }
        __atomic_add_fetch(&e->used, 1, __ATOMIC_RELAXED);
        ret = prep_chunk(e, id);
        if (ret < 0)
            break;
        queued++;
    }
    pthread_mutex_unlock(&e->lock);
    if (ret < 0)
        return ret;
    if (queued) {
        do {
            ret = io_uring_submit(&e->ring);
        } while (ret == -EINTR);
        /* Short of kernel memory or CQ room for now: the SQEs stay in the ring and the next
         * io_uring_submit_and_wait in tm_engine_run hands them over. */
        if (ret < 0 && ret != -EAGAIN && ret != -EBUSY)
            return ret;
        e->stats[TM_STAT_SUBMITS]++;
    }
    return 0;
}

/* After a fatal error: chunks still in the kernel may write into callers' buffers, so wait for them
 * (at most ~10 s: SQEs that never reached the kernel never complete) before the error is reported
 * and the callers' futures fail. */
static int drain_and_fail(struct tm_engine *e, int err)
{
    struct __kernel_timespec ts = { .tv_sec = 1, .tv_nsec = 0 };
    struct io_uring_cqe *cqe;
    uint64_t ud;
    int tries = 10, ret;

    while (used_now(e) > e->nretry && tries > 0) {
        ret = io_uring_wait_cqe_timeout(&e->ring, &cqe, &ts);
        if (ret == -EINTR)
            continue;
        if (ret < 0) {
            tries--;
            continue;
        }
        ud = io_uring_cqe_get_data64(cqe);
        ret = cqe->res;
        io_uring_cqe_seen(&e->ring, cqe);
        if (ud == WAKE_ID)
            e->wake_armed = 0;
        else
            finish_chunk(e, (unsigned)ud, ret < 0 ? ret : 0);
    }
    e->ndone = 0; /* the caller fails every live request */
    return err;
}

static int push_done(struct tm_engine *e, struct request *r)
{
    struct tm_done *d;

    if (e->ndone == e->done_cap) {
        d = realloc(e->done, 2 * e->done_cap * sizeof(*d));
        if (!d)
            return -ENOMEM;
        e->done = d;
        e->done_cap *= 2;
    }
    d = &e->done[e->ndone++];
    d->user_data = r->user_data;
    d->res = r->err;
    d->err_index = r->err_index;
    d->err_offset = r->err_offset;
    d->err_len = r->err_len;
    free(r);
    return 0;
}

static int finish_chunk(struct tm_engine *e, unsigned id, int32_t err)
{
    struct slot *s = &e->slots[id];
    struct node *n = s->n;
    struct request *r = n->req;

    if (err && !r->err) {
        r->err = err;
        r->err_index = n->index;
        r->err_offset = s->offset;
        r->err_len = s->len;
    }
    s->n = NULL;
    e->free_ids[e->nfree++] = id;
    __atomic_sub_fetch(&e->used, 1, __ATOMIC_RELAXED);
    if (--n->outstanding == 0 && n->issued == n->x.len && --r->left == 0)
        return push_done(e, r);
    return 0;
}

static int complete(struct tm_engine *e, uint64_t user_data, int32_t res)
{
    struct slot *s;
    unsigned id;

    if (user_data == WAKE_ID) {
        e->wake_armed = 0;
        return 0;
    }
    id = (unsigned)user_data;
    s = &e->slots[id];
    if (res == -EAGAIN || res == -EINTR) {
        e->stats[TM_STAT_RETRIES]++;
        e->retry[e->nretry++] = id;
        return 0;
    }
    if (res < 0)
        return finish_chunk(e, id, res);
    if (res == 0)
        return finish_chunk(e, id, s->n->x.op == TM_OP_READ ? TM_ERR_EOF : -ENOSPC);
    if ((uint32_t)res < s->len) { /* short: the rest goes in again */
        s->addr += (uint32_t)res;
        s->offset += (uint32_t)res;
        s->len -= (uint32_t)res;
        e->stats[TM_STAT_RETRIES]++;
        e->retry[e->nretry++] = id;
        return 0;
    }
    return finish_chunk(e, id, 0);
}

static unsigned take_done(struct tm_engine *e, struct tm_done *out, unsigned max)
{
    unsigned k = e->ndone < max ? e->ndone : max;

    memcpy(out, e->done, k * sizeof(*out));
    memmove(e->done, e->done + k, (e->ndone - k) * sizeof(*out));
    e->ndone -= k;
    return k;
}

/* The loop's body (called with the GIL released): keep the ring full, and return finished requests
 * (how many were copied to `out`), 0 after tm_engine_kick, or -ESHUTDOWN once stopped and drained.
 * With many chunks in flight it waits for an eighth of them before refilling, so each submit carries
 * several chunks while the ring stays at least 7/8 full. */
int tm_engine_run(struct tm_engine *e, struct tm_done *out, unsigned max)
{
    struct io_uring_cqe *cqe;
    unsigned head, got, used, wait_nr;
    int ret;

    for (;;) {
        ret = fill(e);
        if (ret < 0)
            return drain_and_fail(e, ret);
        if (e->ndone)
            return (int)take_done(e, out, max);
        pthread_mutex_lock(&e->lock);
        if (e->kicked) {
            e->kicked = 0;
            pthread_mutex_unlock(&e->lock);
            return 0;
        }
        used = used_now(e);
        if (e->stopping && !used && !e->head) {
            pthread_mutex_unlock(&e->lock);
            io_uring_unregister_ring_fd(&e->ring); /* registered by this thread in tm_engine_start */
            return -ESHUTDOWN;
        }
        if (e->head && e->nfree) { /* arrived since fill took the lock */
            pthread_mutex_unlock(&e->lock);
            continue;
        }
        e->sleeping = 1;
        pthread_mutex_unlock(&e->lock);
        /* Under half full the loop must wake for the eventfd read alone (see tm_engine_enqueue), so it
         * waits for one completion; above that, for an eighth of what is in flight. */
        wait_nr = used >= (e->qd / 2 ? e->qd / 2 : 1) && used / 8 ? used / 8 : 1;
        /* submits too: SQEs a short or refused submit left in the ring go in now */
        do {
            ret = io_uring_submit_and_wait(&e->ring, wait_nr);
        } while (ret == -EINTR);
        pthread_mutex_lock(&e->lock);
        e->sleeping = 0;
        pthread_mutex_unlock(&e->lock);
        if (ret < 0 && ret != -EAGAIN && ret != -EBUSY && ret != -ETIME)
            return drain_and_fail(e, ret);
        got = 0;
        ret = 0;
        io_uring_for_each_cqe(&e->ring, head, cqe) {
            if (ret == 0)
                ret = complete(e, io_uring_cqe_get_data64(cqe), cqe->res);
            got++;
        }
        io_uring_cq_advance(&e->ring, got);
        if (ret < 0)
            return drain_and_fail(e, ret);
    }
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
