/* Running a kernel's per-thread shares (both codec kernels include this; pipeline/codec/native.py
 * builds them with -fopenmp only where torch's OpenMP runtime is the libgomp.so.1 this build links to,
 * so that the process holds one runtime).
 *
 * With OpenMP the shares run on the runtime's pool, which is torch's: its workers are already started
 * and, right after a torch op, still spinning for the next one, so they take a share at once. Threads
 * started per call cost a start each and compete for the cores with those spinning workers (on a
 * 2-core machine that made the kernel slower with two threads than with one). Without OpenMP, and in
 * a process forked after this library was loaded (libgomp's pool does not survive a fork: a child
 * that uses it waits forever for workers that were not copied), the shares run on new threads.
 */
#ifndef OTL_SHARES_H
#define OTL_SHARES_H

#include <pthread.h>
#include <stddef.h>

#ifdef _OPENMP
#include <omp.h>

static int forked_child = 0;
static void mark_forked_child(void) { forked_child = 1; }
__attribute__((constructor)) static void watch_forks(void) { pthread_atfork(NULL, NULL, mark_forked_child); }
#endif

/* Run run(share t) for t in [0, count), each share `size` bytes into `shares`, on up to count threads,
 * and return when all are done. No result may depend on which thread runs which share. */
static void run_shares(void *shares, size_t size, int count, void *(*run)(void *)) {
    char *at = (char *)shares;
    if (count <= 1) {
        if (count == 1) run(at);
        return;
    }
#ifdef _OPENMP
    if (!forked_child) {
        /* the runtime may give fewer threads than asked (nested, or a limit): they take turns */
#pragma omp parallel num_threads(count)
        for (int t = omp_get_thread_num(); t < count; t += omp_get_num_threads()) run(at + (size_t)t * size);
        return;
    }
#endif
    pthread_t ids[64];
    int started[64] = {0};
    for (int t = 1; t < count && t < 64; t++)
        started[t] = pthread_create(&ids[t], NULL, run, at + (size_t)t * size) == 0;
    run(at);
    for (int t = 1; t < count && t < 64; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else run(at + (size_t)t * size); /* no thread to be had: do its share here */
    }
}

#endif
