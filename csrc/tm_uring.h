/*
 * tiermem's native core: an io_uring transfer pipeline over liburing.
 *
 * Python hands over whole requests: one or more pieces, each a buffer range, a file, an offset and a length
 * (a partition striped over several drives is one request of many pieces). The core splits each piece
 * into block-size chunks, keeps at most `queue_depth` chunks in the ring, resubmits short and
 * -EAGAIN/-EINTR chunks, and reports a request once, when the last chunk of its last piece has finished.
 * So the cost that Python pays is per request, and the per-chunk work (the part that tracks the request
 * count, like fio's) stays in C. See [Note: the ring loop] in tiermem/io/uring.py for the threading.
 *
 * Every function returns 0 (or a count) on success and a negative errno on failure.
 */
#ifndef TM_URING_H
#define TM_URING_H

#include <stdint.h>

#define TM_OP_READ 0
#define TM_OP_WRITE 1

/* tm_done.res for a read that reached the end of the file before its last byte */
#define TM_ERR_EOF 1

/* tm_engine_stats: submit system calls, chunks put in the ring (resubmissions included), chunks that
 * used a registered buffer, chunks resubmitted after a short transfer or -EAGAIN/-EINTR */
#define TM_STAT_SUBMITS 0
#define TM_STAT_CHUNKS 1
#define TM_STAT_FIXED 2
#define TM_STAT_RETRIES 3
#define TM_NSTATS 4

struct tm_engine;

/* One piece of a request. Chunks whose address, offset and length are all multiples of `align` go to
 * `fd` (O_DIRECT); the others (odd tails, unaligned buffers) go to `buffered_fd`. align 0: always `fd`. */
struct tm_xfer {
    uint64_t addr;
    uint64_t offset;
    uint64_t len;
    int32_t fd;
    int32_t buffered_fd;
    int32_t op;
    uint32_t align;
};

/* A finished request. res: 0, a negative errno, or TM_ERR_EOF. On failure err_index is the piece and
 * err_offset/err_len the first chunk that failed (its file offset and the bytes it still had to move). */
struct tm_done {
    uint64_t user_data;
    int32_t res;
    uint32_t err_index;
    uint64_t err_offset;
    uint64_t err_len;
};

int tm_engine_open(unsigned queue_depth, uint32_t block_size, int sqpoll, unsigned sq_idle_ms,
                   struct tm_engine **out);
void tm_engine_close(struct tm_engine *eng);
int tm_engine_start(struct tm_engine *eng);
int tm_engine_enqueue(struct tm_engine *eng, uint64_t user_data, const struct tm_xfer *xfers, unsigned n);
int tm_engine_run(struct tm_engine *eng, struct tm_done *out, unsigned max);
void tm_engine_kick(struct tm_engine *eng, int stop);
int tm_engine_register_buffers(struct tm_engine *eng, const uint64_t *addrs, const uint64_t *lens, unsigned n);
void tm_engine_stats(struct tm_engine *eng, uint64_t *out);
int tm_ring_probe(void);

#endif
