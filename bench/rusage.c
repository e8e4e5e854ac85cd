/*
 * rusage: run a command and report its wall time and peak RSS.
 *
 *   rusage REPORT CMD [ARGS...]
 *
 * Forks, execs CMD, waits for it with wait4() and writes one JSON object to
 * the file REPORT: wall_s, user_s, sys_s, maxrss_kb, exit status.  CMD's
 * stdin/stdout/stderr are inherited.  Exits with CMD's exit code.
 *
 * Why not let Python measure: a child spawned by a large parent (with
 * vfork, as subprocess does) inherits the parent's RSS high-water mark at
 * exec time, so ru_maxrss of e.g. `cp` would show the benchmark driver's
 * size.  This process is small, so its children start from a small mark.
 *
 * Build: cc -O2 -o rusage rusage.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double tv(struct timeval t)
{
    return (double)t.tv_sec + (double)t.tv_usec * 1e-6;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: rusage REPORT CMD [ARGS...]\n");
        return 2;
    }
    FILE *rep = fopen(argv[1], "w");
    if (!rep) {
        fprintf(stderr, "rusage: %s: %s\n", argv[1], strerror(errno));
        return 2;
    }
    double t0 = now();
    pid_t pid = fork();
    if (pid < 0) {
        perror("rusage: fork");
        return 2;
    }
    if (pid == 0) {
        execvp(argv[2], argv + 2);
        fprintf(stderr, "rusage: exec %s: %s\n", argv[2], strerror(errno));
        _exit(127);
    }
    int status;
    struct rusage ru;
    while (wait4(pid, &status, 0, &ru) < 0) {
        if (errno != EINTR) {
            perror("rusage: wait4");
            return 2;
        }
    }
    double wall = now() - t0;
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    fprintf(rep,
            "{\"wall_s\": %.6f, \"user_s\": %.6f, \"sys_s\": %.6f, \"maxrss_kb\": %ld, "
            "\"exit\": %d}\n",
            wall, tv(ru.ru_utime), tv(ru.ru_stime), ru.ru_maxrss, code);
    fclose(rep);
    return code;
}
