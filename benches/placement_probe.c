// The cost of a cross-CPU transfer through shared memory, plain against streaming stores.
//
// Build and run: `gcc -O2 -mavx2 -o /tmp/placement benches/placement_probe.c &&
// /tmp/placement 512 30 2000` (KiB per transfer, samples, ms between samples). One process
// on CPU 0 writes S bytes into a shared buffer that a second process, on CPU 1, read in
// the previous round, then the second reads them; per sample it prints the medians (us)
// of 41 rounds of the write and the read, with `memcpy` and with streaming stores
// (`_mm256_stream_si256`, then `sfence`). Samples seconds apart show the VM's placements
// of its two vCPUs (rust/stream.rs, docs/benchmark.md "The VM's placements").
#define _GNU_SOURCE
#include <immintrin.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <stdatomic.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }
static void pin(int c) { cpu_set_t s; CPU_ZERO(&s); CPU_SET(c, &s); sched_setaffinity(0, sizeof s, &s); }
static void nt_copy(char *d, const char *s, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    __m256i a = _mm256_load_si256((const __m256i *)(s + i)), b = _mm256_load_si256((const __m256i *)(s + i + 32));
    _mm256_stream_si256((__m256i *)(d + i), a); _mm256_stream_si256((__m256i *)(d + i + 32), b);
  }
  _mm_sfence();
}
static int cmp(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return (x > y) - (x < y); }
int main(int argc, char **argv) {
  size_t S = (size_t)atol(argv[1]) << 10; int samples = atoi(argv[2]); int gap_ms = atoi(argv[3]);
  enum { K = 41 };
  char *sh = mmap(0, S + 4096 * 2, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  _Atomic long *flag = (_Atomic long *)(sh + S); double *rv = (double *)(sh + S + 4096);
  char *buf = sh;
  pid_t pid = fork();
  if (!pid) {
    pin(1); char *dst = aligned_alloc(64, S); memset(dst, 0, S); long i = 0;
    for (;;) {
      i++;
      while (atomic_load(&flag[0]) < i) if (atomic_load(&flag[0]) < 0) _exit(0);
      double t = now(); memcpy(dst, buf, S); rv[0] = now() - t;
      atomic_store(&flag[1], i);
    }
  }
  pin(0); char *src = aligned_alloc(64, S); memset(src, 1, S); long i = 0;
  for (int s = 0; s < samples; s++) {
    double w[2][K], r[2][K];
    for (int k = 0; k < K; k++) for (int mode = 0; mode < 2; mode++) {
      i++;
      double t = now(); if (mode) nt_copy(buf, src, S); else memcpy(buf, src, S); w[mode][k] = now() - t;
      atomic_store(&flag[0], i);
      while (atomic_load(&flag[1]) < i) ;
      r[mode][k] = rv[0];
    }
    for (int m = 0; m < 2; m++) { qsort(w[m], K, 8, cmp); qsort(r[m], K, 8, cmp); }
    time_t tt = time(0); char ts[16]; strftime(ts, 16, "%H:%M:%S", gmtime(&tt));
    printf("%s memcpy: write %.1f read %.1f sum %.1f | nt: write %.1f read %.1f sum %.1f\n", ts, w[0][K/2], r[0][K/2],
           w[0][K/2] + r[0][K/2], w[1][K/2], r[1][K/2], w[1][K/2] + r[1][K/2]);
    fflush(stdout); usleep(gap_ms * 1000);
  }
  atomic_store(&flag[0], -1); wait(0); return 0;
}
