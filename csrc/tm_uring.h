/*
 * tiermem's native core: a thin, data-only layer over liburing.
 *
 * Every function returns 0 (or a count) on success and a negative errno on failure; none of them
 * holds policy. Splitting, queue depth, retries and fallbacks are decided in Python
 * (tiermem/io/uring.py), which calls these with the GIL released.
 */
#ifndef TM_URING_H
#define TM_URING_H

#include <stdint.h>

#define TM_OP_READ 0
#define TM_OP_WRITE 1
#define TM_OP_NOP 2

struct tm_ring;

/* One request to queue: `buf_index` >= 0 selects a registered (fixed) buffer that holds `addr`. */
struct tm_req {
    uint64_t user_data;
    uint64_t addr;
    uint64_t offset;
    uint32_t len;
    int32_t fd;
    int32_t op;
    int32_t buf_index;
};

/* One completion: `res` is the byte count or a negative errno. */
struct tm_cqe {
    uint64_t user_data;
    int32_t res;
    uint32_t flags;
};

int tm_ring_open(unsigned entries, int sqpoll, unsigned sq_idle_ms, struct tm_ring **out);
void tm_ring_close(struct tm_ring *ring);
unsigned tm_ring_sq_entries(struct tm_ring *ring);
unsigned tm_ring_features(struct tm_ring *ring);
int tm_ring_register_buffers(struct tm_ring *ring, const uint64_t *addrs, const uint64_t *lens, unsigned n);
int tm_ring_unregister_buffers(struct tm_ring *ring);
int tm_ring_submit(struct tm_ring *ring, const struct tm_req *reqs, unsigned n);
int tm_ring_reap(struct tm_ring *ring, struct tm_cqe *out, unsigned max, unsigned wait_nr);
int tm_ring_probe(void);

#endif
