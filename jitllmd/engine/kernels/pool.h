/* pool.c's parallel loop, for the kernels' sources: see pool.c's header for how it claims work and why. */
#ifndef JITLLMD_POOL_H
#define JITLLMD_POOL_H
#include <stdint.h>

/* Runs fn(ctx, i) for every i in [0, n), on the calling thread and up to threads - 1 pool workers, and returns when
 * all n are done. Work is claimed run by run (consecutive i's) from an atomic word, so a worker the OS has not
 * scheduled claims nothing and the caller does the rest itself; the caller waits only for runs a worker has already
 * claimed. With threads <= 1, n <= 1, from inside fn, or while another thread's call holds the pool: inline. */
void pool_for(int64_t n, int threads, void (*fn)(void *ctx, int64_t i), void *ctx);

#endif
