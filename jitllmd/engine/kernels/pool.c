/* A persistent thread pool whose calls never wait for a thread that has not started work: what the kernels' loops
 * run on instead of OpenMP's `parallel for schedule(static)`, whose static split and closing barrier make a call wait
 * a whole scheduler slice (~10 ms, for a 50 us call) for a second thread the OS has not run yet on a busy machine.
 *
 * pool_for(n, threads, fn, ctx) runs fn(ctx, i) for i in [0, n). The range is cut into runs of consecutive i that
 * shrink as they go (plan_runs: each half of what is left over the threads, down to n / TAIL), so
 * the first runs are long streams over the weights and the last ones short: a thread that runs out of work waits for
 * at most a short run. They are claimed one at a time by the caller and up to threads - 1 workers from one atomic word, `state`:
 * a job's sequence number (24 bits), its threads (8), its runs (16) and the next run to claim (16). A thread claims
 * by compare-and-swap on that word, so it can only take a run of the job that word names, while it is open; it reads
 * the job's fn, ctx, n only after its claim succeeds, when the job cannot finish (and the caller cannot post another)
 * before it reports its run done. A late worker (woken after its job finished, or across several jobs) finds every
 * run claimed and claims nothing. The caller runs runs until none are left, then waits only for runs claimed by
 * workers that are running them. Jobs are serialised by a mutex taken with trylock: a call made while the pool is
 * busy (another caller, or fn itself calling pool_for) runs its loop inline.
 *
 * Memory order: a job's fields are stored relaxed and published by the (seq_cst, so release) store of its state;
 * claims are acq_rel CASes on it; a worker reports its runs with a release add to `done`, which the caller's acquire
 * loads see before it returns (so fn's writes are visible to it, and no worker still reads the job's fields).
 *
 * Workers are detached pthreads with every signal blocked, made lazily (grown when a call asks for more threads).
 * Between jobs each spins with _mm_pause up to SPIN_NS, yielding its core whenever it finds itself on the caller's
 * (where it would delay the caller, or the Python work between calls), then sleeps on a futex word the caller bumps
 * per job; the caller makes the futex call only when some worker sleeps. A caller waiting on claimed runs pauses for
 * YIELD_NS, then yields between checks. In a child after fork() the pool forgets the parent's workers (atfork) and
 * makes its own on demand.
 *
 * Built with the kernels but uses no OpenMP.
 */
#define _GNU_SOURCE /* sched_getcpu */
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "pool.h"

#define MAX_WORKERS 63      /* threads fit state's 8 bits */
#define MAX_RUNS 256        /* runs a job is cut into, at most: plan_runs makes ~16 for 2 threads, under 180 for 63 */
#define TAIL 128            /* the shortest run: n / TAIL (or one i): 1/64 of a thread's share on 2 threads */
#ifndef SPIN_NS
#define SPIN_NS 200000      /* a worker's wait for the next job before it sleeps: longer than a decode step's gaps between calls */
#endif
#ifndef YIELD_NS
#define YIELD_NS 10000      /* the caller's wait on claimed runs before it yields its core between checks */
#endif

/* state: seq << 40 | threads << 32 | runs << 16 | next */
#define SEQ(s) ((s) >> 40)
#define THREADS(s) ((int)((s) >> 32 & 0xff))
#define RUNS(s) ((int64_t)((s) >> 16 & 0xffff))
#define NEXT(s) ((int64_t)((s) & 0xffff))

typedef void (*pool_fn)(void *ctx, int64_t i);

static struct {
    _Atomic uint64_t state;   /* the job, and its next run to claim */
    _Atomic(pool_fn) fn;      /* the job's fields: written before its state is published, read only after a claim */
    _Atomic(void *) ctx;
    _Atomic int64_t bound[MAX_RUNS + 1]; /* run r: i in [bound[r], bound[r + 1]) */
    _Atomic int64_t done;     /* i's finished by workers in this job */
    _Atomic uint32_t posted;  /* futex word: bumped per job */
    _Atomic int sleepers;     /* workers in (or about to enter) futex_wait */
    _Atomic int caller_cpu;   /* where the last job's caller ran */
    int workers;              /* made so far (under lock) */
    pthread_mutex_t lock;     /* held by the caller of the job in flight */
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

static pthread_once_t once = PTHREAD_ONCE_INIT;

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Claims one run of the open job for thread `id` (0: the caller); returns how many i it ran, 0 when none was left. */
static int64_t run_one(int id) {
    uint64_t s = atomic_load_explicit(&pool.state, memory_order_acquire);
    do {
        if (NEXT(s) >= RUNS(s) || id >= THREADS(s)) return 0;
    } while (!atomic_compare_exchange_weak_explicit(&pool.state, &s, s + 1, memory_order_acq_rel, memory_order_acquire));
    /* the job stays open until this run is reported done: its fields are the ones the claim was for */
    const pool_fn fn = atomic_load_explicit(&pool.fn, memory_order_relaxed);
    void *ctx = atomic_load_explicit(&pool.ctx, memory_order_relaxed);
    const int64_t lo = atomic_load_explicit(&pool.bound[NEXT(s)], memory_order_relaxed);
    const int64_t hi = atomic_load_explicit(&pool.bound[NEXT(s) + 1], memory_order_relaxed);
    for (int64_t i = lo; i < hi; i++) fn(ctx, i);
    return hi - lo;
}

static int has_work(int id) {
    const uint64_t s = atomic_load_explicit(&pool.state, memory_order_acquire);
    return NEXT(s) < RUNS(s) && id < THREADS(s);
}

static void *worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    for (;;) {
        const uint32_t seen = atomic_load_explicit(&pool.posted, memory_order_seq_cst);
        for (int64_t ran; (ran = run_one(id));) atomic_fetch_add_explicit(&pool.done, ran, memory_order_release);
        const uint64_t start = now_ns();
        for (uint64_t k = 1; !has_work(id); k++) {
            _mm_pause();
            if (k % 64) continue;
            if (now_ns() - start > SPIN_NS) {
                atomic_fetch_add_explicit(&pool.sleepers, 1, memory_order_seq_cst);
                /* returns at once if a job was posted since `seen` (the kernel compares the word) */
                syscall(SYS_futex, &pool.posted, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub_explicit(&pool.sleepers, 1, memory_order_relaxed);
                break;
            }
            /* on the caller's core (woken onto it, or it onto ours) we would spin in its way: let it run */
            if (sched_getcpu() == atomic_load_explicit(&pool.caller_cpu, memory_order_relaxed)) sched_yield();
        }
    }
    return NULL;
}

/* In a fork()'s child: the parent's workers do not exist here, nor a job in flight. */
static void forget_workers(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pool.workers = 0;
    atomic_store(&pool.sleepers, 0);
    const uint64_t s = atomic_load(&pool.state);
    atomic_store(&pool.state, (SEQ(s) + 1) << 40); /* no runs: nothing to claim */
}

static void setup(void) { pthread_atfork(NULL, NULL, forget_workers); }

/* Under lock: makes workers until `want` exist (fewer if the system refuses threads). */
static void grow(int want) {
    pthread_once(&once, setup);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    sigset_t all, old; /* workers take no signals: they stay with the threads that handle them (Python's main) */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    for (pthread_t t; pool.workers < want && pthread_create(&t, &attr, worker, (void *)(intptr_t)(pool.workers + 1)) == 0;) pool.workers++;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
}

/* [0, n) cut for `threads` into runs, guided self-scheduling's way: each run half of what is left over the threads, none
 * shorter than n / TAIL (nor than one i); bound[r] .. bound[r + 1] is run r. Returns the runs: the shrinking ones
 * number about 2 threads ln(TAIL / 2 threads) (at most ~47, threads ~23), the shortest ones at most 2 threads.
 * Equal runs (n / 16 for 2 threads, as before) left the caller waiting on a worker's last run for 3.7% of a Qwen
 * 1.5B batch-1 decode's product time and 1.5-4% of a prompt's (2 cores, Sapphire Rapids, avx2+fma); these, 0.6% and
 * 0.2-0.4%. Long first runs also keep each thread's weight stream whole, which is why fewer runs decoded quicker. */
static int64_t plan_runs(int64_t n, int threads, int64_t *bound) {
    const int64_t least = (n + TAIL - 1) / TAIL;
    int64_t runs = 0;
    for (int64_t at = 0; at < n; runs++) {
        int64_t size = (n - at + 2 * threads - 1) / (2 * threads);
        if (size < least) size = least;
        if (at + size > n || runs == MAX_RUNS - 1) size = n - at;
        bound[runs] = at;
        at += size;
    }
    bound[runs] = n;
    return runs;
}

void pool_for(int64_t n, int threads, void (*fn)(void *ctx, int64_t i), void *ctx) {
    if (threads > MAX_WORKERS + 1) threads = MAX_WORKERS + 1;
    if (n <= 1 || threads <= 1 || pthread_mutex_trylock(&pool.lock) != 0) {
        for (int64_t i = 0; i < n; i++) fn(ctx, i);
        return;
    }
    if (pool.workers < threads - 1) grow(threads - 1);
    if (threads > pool.workers + 1) threads = pool.workers + 1;
    int64_t bound[MAX_RUNS + 1];
    const int64_t runs = plan_runs(n, threads, bound);
    for (int64_t r = 0; r <= runs; r++) atomic_store_explicit(&pool.bound[r], bound[r], memory_order_relaxed);
    atomic_store_explicit(&pool.fn, fn, memory_order_relaxed);
    atomic_store_explicit(&pool.ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.caller_cpu, sched_getcpu(), memory_order_relaxed);
    const uint64_t seq = (SEQ(atomic_load_explicit(&pool.state, memory_order_relaxed)) + 1) & 0xffffff;
    /* publishes the fields above; only the caller changes state's upper bits, so a plain store is the new job */
    atomic_store_explicit(&pool.state, seq << 40 | (uint64_t)threads << 32 | (uint64_t)runs << 16, memory_order_seq_cst);
    atomic_fetch_add_explicit(&pool.posted, 1, memory_order_seq_cst);
    if (atomic_load_explicit(&pool.sleepers, memory_order_seq_cst) > 0) syscall(SYS_futex, &pool.posted, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
    int64_t own = 0;
    for (int64_t ran; (ran = run_one(0));) own += ran;
    if (own < n) { /* runs a worker claimed and is running: wait for those only */
        const uint64_t start = now_ns();
        for (uint64_t k = 1, waited = 0; atomic_load_explicit(&pool.done, memory_order_acquire) + own < n; k++) {
            if (waited < YIELD_NS) {
                _mm_pause();
                if (k % 64 == 0) waited = now_ns() - start;
            } else {
                sched_yield(); /* a worker woken onto this core may be what we wait for */
            }
        }
    }
    pthread_mutex_unlock(&pool.lock);
}

/* ---- test entry points ---- */

typedef struct {
    _Atomic int64_t *counts, sum;
    int64_t work, inner;
    int threads;
} test_job;

static void test_chunk(void *arg, int64_t i) {
    test_job *job = arg;
    double x = (double)i; /* `work` units of a dependent multiply-add chain (~1 us each): a kernel's compute */
    for (int64_t k = 0; k < job->work * 1000; k++) x = x * 0.999999 + 1e-7;
    __asm__ volatile("" : : "x"(x));
    if (job->counts) atomic_fetch_add_explicit(&job->counts[i], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&job->sum, i, memory_order_relaxed);
}

/* pool_for over n chunks on `threads`: chunk i adds 1 to counts[i] (when given) and i to the sum it returns, after
 * `work` units of compute. */
int64_t pool_test_sum(int64_t n, int threads, int64_t work, int64_t *counts) {
    test_job job = {.counts = (_Atomic int64_t *)counts, .work = work};
    pool_for(n, threads, test_chunk, &job);
    return atomic_load(&job.sum);
}

static void test_outer(void *arg, int64_t i) {
    test_job *job = arg;
    test_job in = {.counts = job->counts ? job->counts + i * job->inner : NULL};
    pool_for(job->inner, job->threads, test_chunk, &in); /* nested: runs inline */
    atomic_fetch_add_explicit(&job->sum, atomic_load(&in.sum), memory_order_relaxed);
}

/* pool_for over n chunks each running pool_for over `inner` (i * inner + j adds 1 to counts[i * inner + j]);
 * returns the sum of the inner j's. */
int64_t pool_test_nested(int64_t n, int64_t inner, int threads, int64_t *counts) {
    test_job job = {.counts = (_Atomic int64_t *)counts, .inner = inner, .threads = threads};
    pool_for(n, threads, test_outer, &job);
    return atomic_load(&job.sum);
}

/* plan_runs(n, threads) into bound [MAX_RUNS + 1]: the runs' count. */
int64_t pool_test_runs(int64_t n, int threads, int64_t *bound) { return plan_runs(n, threads, bound); }

/* The workers this process has made (0 in a fresh fork()'s child). */
int pool_test_workers(void) { return pool.workers; }
