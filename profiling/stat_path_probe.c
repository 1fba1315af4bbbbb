/* How long the match's stat of one block file takes by full path (lstat: the kernel walks every
 * component of the pool root again) and by name relative to an open key directory (fstatat on an
 * O_PATH descriptor: one component), for 4096 files in 256 key directories, on 1 and 8 threads.
 *
 *     gcc -O2 -o /tmp/stat_path_probe profiling/stat_path_probe.c -lpthread
 *     /tmp/stat_path_probe DIR    (DIR: as deep as a pool's fingerprint directory; created inside)
 *
 * native.present_run stats by full path.  This measures what holding the 256 directories open
 * would save, before the connector takes on descriptors that go stale when a directory is removed
 * and recreated (an operator clearing the pool while servers run). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#define N 4096
static char dirs[256][512];
static int dfd[256];
static unsigned char keys[N][32];
static char full[N][700], name[N][80];
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
struct span { int from, to, mode; long bad; };
static void *run(void *a) {
    struct span *s = a; struct stat st; char p[700];
    for (int i = s->from; i < s->to; i++) {
        int r;
        if (s->mode == 0) { snprintf(p, sizeof p, "%s", full[i]); r = lstat(p, &st); }
        else r = fstatat(dfd[keys[i][0]], name[i], &st, AT_SYMLINK_NOFOLLOW);
        if (r || !S_ISREG(st.st_mode)) s->bad++;
    }
    return NULL;
}
static double pass(int mode, int threads) {
    pthread_t t[16]; struct span s[16];
    double t0 = now();
    for (int k = 0; k < threads; k++) { s[k] = (struct span){N * k / threads, N * (k + 1) / threads, mode, 0}; if (k) pthread_create(&t[k], NULL, run, &s[k]); }
    run(&s[0]);
    for (int k = 1; k < threads; k++) pthread_join(t[k], NULL);
    long bad = 0; for (int k = 0; k < threads; k++) bad += s[k].bad;
    if (bad) { fprintf(stderr, "bad %ld\n", bad); exit(1); }
    return now() - t0;
}
static int cmp(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return x < y ? -1 : x > y; }
int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    const char *root = argv[1];
    srand(7);
    for (int b = 0; b < 256; b++) {
        snprintf(dirs[b], sizeof dirs[b], "%s/%02x", root, b);
        mkdir(dirs[b], 0755);
        dfd[b] = open(dirs[b], O_RDONLY | O_DIRECTORY | O_PATH);
    }
    for (int i = 0; i < N; i++) {
        for (int j = 0; j < 32; j++) keys[i][j] = rand() & 255;
        char hex[65]; for (int j = 0; j < 32; j++) sprintf(hex + 2 * j, "%02x", keys[i][j]);
        snprintf(name[i], sizeof name[i], "%s.kvb", hex);
        if (snprintf(full[i], sizeof full[i], "%s/%s", dirs[keys[i][0]], name[i]) >= (int)sizeof full[i]) return 2;
        int fd = open(full[i], O_CREAT | O_WRONLY, 0644); if (fd < 0) { perror(full[i]); return 1; }
        if (ftruncate(fd, 4096)) return 1;
        close(fd);
    }
    int th[] = {1, 8};
    for (int r = 0; r < 5; r++)
        for (int ti = 0; ti < 2; ti++) {
            double a[5], b[5];
            for (int k = 0; k < 5; k++) { a[k] = pass(0, th[ti]); b[k] = pass(1, th[ti]); }
            qsort(a, 5, sizeof *a, cmp); qsort(b, 5, sizeof *b, cmp);
            printf("round %d threads %d: lstat(full path) median %.3f ms, fstatat(dirfd) median %.3f ms, ratio %.2f\n", r, th[ti], a[2] * 1e3, b[2] * 1e3, b[2] / a[2]);
        }
    return 0;
}
