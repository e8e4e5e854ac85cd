/*
 * blockdiff-guestd: the guest daemon, the command channel inside a sandbox VM.
 *
 * Runs as PID 1 of the guest's initramfs. The sandbox disk is mounted at a
 * root directory (default /mnt/root) and every command runs chrooted into it,
 * so any raw disk image with a filesystem the kernel knows can be a sandbox
 * disk without anything installed on it.
 *
 * The host talks to it over a virtio-serial port named org.blockdiff.guestd.
 * Both directions use the same frame: a 16-byte header
 *     "BDA1" | u8 type | u8 0 | u16 0 | u32 request id | u32 payload length
 * (little-endian) followed by the payload. Replies carry the request's id and
 * its type with the high bit set; the host discards replies to ids it no
 * longer waits for, so a host that timed out and reconnected is never
 * confused by an old answer. The byte layouts are in blockdiff/vm/guestlink.py.
 *
 * One request at a time: the daemon is single-threaded and the host holds a
 * per-VM lock, which keeps the protocol free of interleaving.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <linux/random.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define GUESTD_VERSION "blockdiff-guestd 2"
#define PORT_NAME "org.blockdiff.guestd"
#define MAX_PAYLOAD (64u << 20)
#define MAX_OUTPUT (16u << 20)

enum {
    T_PING = 1, T_EXEC = 2, T_FREEZE = 3, T_THAW = 4, T_SYNC = 5, T_SHUTDOWN = 6,
    T_DETACH = 7, T_ATTACH = 8, T_RESUME = 9,
    T_REPLY = 0x80, T_ERROR = 0xff,
};
enum { EXEC_TIMED_OUT = 1, EXEC_TRUNCATED = 2 };
enum { FREEZE_PROCESSES = 1 };

static const char *root = "/mnt/root";
static const char *disk = "/dev/vda";
static const char *const binds[] = {"proc", "sys", "dev"};
static int port = -1;
static int frozen;                 /* the root filesystem is frozen */
static int64_t thaw_deadline_ms;   /* thaw by itself then, if the host never does */
/* Every command runs in this cgroup (v2), so that a checkpoint of the VM's
 * memory can freeze them all: none of them then runs between a restore and
 * the moment the guest's clock and random-number generator are fixed. */
static const char *cgroup = "/run/blockdiff-cgroup/sandbox";
static int have_cgroup;
static int processes_frozen;

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void logmsg(const char *fmt, const char *arg)
{
    /* The console (ttyS0) goes to console.log on the host: boot problems are
     * diagnosed from there. */
    fprintf(stderr, "blockdiff-guestd: ");
    fprintf(stderr, fmt, arg);
    fputc('\n', stderr);
}

static uint32_t get32(const unsigned char *p)
{
    return p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24;
}

static void put32(unsigned char *p, uint32_t v)
{
    p[0] = v; p[1] = v >> 8; p[2] = v >> 16; p[3] = v >> 24;
}

/* ------------------------------------------------------------ the port */

static int find_port(char *path, size_t size)
{
    DIR *d = opendir("/sys/class/virtio-ports");
    struct dirent *e;
    int found = 0;
    if (!d)
        return 0;
    while (!found && (e = readdir(d))) {
        char namefile[512], name[128] = {0};
        int fd;
        if (e->d_name[0] == '.')
            continue;
        snprintf(namefile, sizeof namefile, "/sys/class/virtio-ports/%s/name", e->d_name);
        fd = open(namefile, O_RDONLY);
        if (fd < 0)
            continue;
        if (read(fd, name, sizeof name - 1) > 0) {
            name[strcspn(name, "\n")] = 0;
            if (!strcmp(name, PORT_NAME)) {
                snprintf(path, size, "/dev/%s", e->d_name);
                found = 1;
            }
        }
        close(fd);
    }
    closedir(d);
    return found;
}

static void thaw_if_overdue(void);

/* PID 1 reaps the orphans every command leaves behind. Before each request
 * as well as after each exec: a process killed by one command may end after
 * that command's reply, and as a zombie it would still answer kill -0 and
 * show in ps for as long as no later exec ended. */
static void reap_orphans(void)
{
    while (waitpid(-1, NULL, WNOHANG) > 0)
        ;
}

/* Read exactly n bytes. While the host is not connected the port reports
 * POLLHUP; wait for it to come back instead of spinning. */
static int read_full(unsigned char *buf, size_t n)
{
    size_t got = 0;
    while (got < n) {
        struct pollfd p = {.fd = port, .events = POLLIN};
        int r = poll(&p, 1, 200);
        thaw_if_overdue();
        if (r < 0 && errno != EINTR)
            return -1;
        if (r <= 0)
            continue;
        if (!(p.revents & POLLIN)) {
            usleep(20000);
            continue;
        }
        ssize_t k = read(port, buf + got, n - got);
        if (k < 0 && errno != EINTR && errno != EAGAIN)
            return -1;
        if (k > 0)
            got += k;
    }
    return 0;
}

static void write_full(const unsigned char *buf, size_t n)
{
    while (n) {
        ssize_t k = write(port, buf, n);
        if (k < 0) {
            if (errno == EINTR || errno == EAGAIN) {
                struct pollfd p = {.fd = port, .events = POLLOUT};
                poll(&p, 1, 100);
                continue;
            }
            return; /* the host went away: it will ask again */
        }
        buf += k;
        n -= k;
    }
}

static void send_frame(int type, uint32_t id, const void *a, size_t alen, const void *b,
                       size_t blen, const void *c, size_t clen)
{
    unsigned char h[16] = {'B', 'D', 'A', '1', (unsigned char)type, 0, 0, 0};
    put32(h + 8, id);
    put32(h + 12, alen + blen + clen);
    write_full(h, sizeof h);
    if (alen) write_full(a, alen);
    if (blen) write_full(b, blen);
    if (clen) write_full(c, clen);
}

static void send_error(uint32_t id, const char *msg)
{
    send_frame(T_ERROR, id, msg, strlen(msg), NULL, 0, NULL, 0);
}

static void send_status(int type, uint32_t id, int err)
{
    unsigned char v[4];
    put32(v, (uint32_t)err);
    send_frame(type | T_REPLY, id, v, 4, NULL, 0, NULL, 0);
}

/* ------------------------------------------------------------- freezing */

static int freeze_root(void)
{
    int fd = open(root, O_RDONLY | O_DIRECTORY), err = 0;
    if (fd < 0)
        return errno;
    if (ioctl(fd, FIFREEZE, 0) < 0 && errno != EBUSY)
        err = errno;
    close(fd);
    return err;
}

static int thaw_root(void)
{
    int fd = open(root, O_RDONLY | O_DIRECTORY), err = 0;
    if (fd < 0)
        return errno;
    if (ioctl(fd, FITHAW, 0) < 0 && errno != EINVAL)  /* EINVAL: not frozen */
        err = errno;
    close(fd);
    frozen = 0;
    return err;
}

/* ------------------------------------------------ the commands' cgroup */

static int write_file(const char *dir, const char *name, const char *value)
{
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = open(path, O_WRONLY | O_CLOEXEC), err = 0;
    if (fd < 0)
        return errno;
    if (write(fd, value, strlen(value)) < 0)
        err = errno;
    close(fd);
    return err;
}

static void setup_cgroup(void)
{
    mkdir("/run", 0755);
    mkdir("/run/blockdiff-cgroup", 0755);
    if (mount("cgroup2", "/run/blockdiff-cgroup", "cgroup2", 0, NULL) < 0 && errno != EBUSY) {
        logmsg("no cgroup2 (%s): memory checkpoints cannot hold the guest's processes",
               strerror(errno));
        return;
    }
    if (mkdir(cgroup, 0755) < 0 && errno != EEXIST) {
        logmsg("cannot make the commands' cgroup: %s", strerror(errno));
        return;
    }
    have_cgroup = 1;
}

/* Freeze (1) or thaw (0) every command and what it started; waits until the
 * kernel says they are all frozen. */
static int freeze_processes(int on)
{
    if (!have_cgroup)
        return on ? ENOSYS : 0;
    int err = write_file(cgroup, "cgroup.freeze", on ? "1" : "0");
    if (err || !on) {
        processes_frozen = 0;
        return err;
    }
    char path[256], events[256];
    snprintf(path, sizeof path, "%s/cgroup.events", cgroup);
    for (int64_t deadline = now_ms() + 10000; now_ms() < deadline; usleep(500)) {
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        ssize_t k = fd < 0 ? -1 : read(fd, events, sizeof events - 1);
        if (fd >= 0)
            close(fd);
        if (k > 0) {
            events[k] = 0;
            if (strstr(events, "frozen 1")) {
                processes_frozen = 1;
                return 0;
            }
        }
    }
    write_file(cgroup, "cgroup.freeze", "0");
    return ETIMEDOUT;
}

static void thaw_if_overdue(void)
{
    if ((frozen || processes_frozen) && now_ms() >= thaw_deadline_ms) {
        logmsg("%s", "the host never thawed the disk; thawing it");
        thaw_root();
        freeze_processes(0);
    }
}

static int sync_root(void)
{
    int fd = open(root, O_RDONLY | O_DIRECTORY), err = 0;
    if (fd < 0)
        return errno;
    if (syncfs(fd) < 0)
        err = errno;
    close(fd);
    return err;
}

/* --------------------------------------------------------------- exec */

struct buf {
    unsigned char *data;
    size_t len, cap;
    int truncated;
};

static void buf_add(struct buf *b, const unsigned char *p, size_t n)
{
    if (b->len + n > MAX_OUTPUT) {
        n = MAX_OUTPUT - b->len;
        b->truncated = 1;
    }
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 65536;
        while (cap < b->len + n)
            cap *= 2;
        unsigned char *d = realloc(b->data, cap);
        if (!d) {
            b->truncated = 1;
            return;
        }
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, p, n);
    b->len += n;
}

/* Drain a pipe into a buffer; returns 0 at end of file. */
static int drain(int fd, struct buf *b)
{
    unsigned char chunk[65536];
    for (;;) {
        ssize_t k = read(fd, chunk, sizeof chunk);
        if (k > 0) {
            buf_add(b, chunk, k);
            continue;
        }
        if (k == 0)
            return 0;
        return errno == EAGAIN || errno == EINTR ? 1 : 0;
    }
}

static void child(char **argv, const char *cwd, int in, int out, int err)
{
    dup2(in, 0);
    dup2(out, 1);
    dup2(err, 2);
    setsid();
    signal(SIGPIPE, SIG_DFL);
    if (have_cgroup)
        write_file(cgroup, "cgroup.procs", "0");
    /* A login-like environment of the disk's system, not the initramfs's. */
    clearenv();
    setenv("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", 1);
    setenv("HOME", "/root", 1);
    setenv("USER", "root", 1);
    setenv("LOGNAME", "root", 1);
    if (chroot(root) < 0 || chdir(cwd[0] ? cwd : "/") < 0) {
        dprintf(2, "blockdiff-guestd: cannot enter %s (%s): %s\n", root, cwd, strerror(errno));
        _exit(126);
    }
    execvp(argv[0], argv);
    dprintf(2, "blockdiff-guestd: %s: %s\n", argv[0], strerror(errno));
    _exit(errno == ENOENT ? 127 : 126);
}

/* payload: u32 timeout_ms | u32 argc | u32 stdin_len | u32 0 | argv\0... | cwd\0 | stdin */
static void do_exec(uint32_t id, unsigned char *p, uint32_t len)
{
    if (len < 16) {
        send_error(id, "exec: short request");
        return;
    }
    uint32_t timeout_ms = get32(p), argc = get32(p + 4), in_len = get32(p + 8);
    unsigned char *s = p + 16, *end = p + len;
    if (argc == 0 || argc > 65536 || in_len > len) {
        send_error(id, "exec: malformed request");
        return;
    }
    char **argv = calloc(argc + 1, sizeof *argv);
    const char *cwd = NULL;
    for (uint32_t i = 0; argv && i <= argc; i++) {  /* argc strings, then the cwd */
        unsigned char *z = memchr(s, 0, end - s);
        if (!z)
            break;
        if (i < argc)
            argv[i] = (char *)s;
        else
            cwd = (char *)s;
        s = z + 1;
    }
    if (!cwd) {
        free(argv);
        send_error(id, "exec: malformed request");
        return;
    }
    if ((size_t)(end - s) != in_len) {
        free(argv);
        send_error(id, "exec: malformed request");
        return;
    }

    int pin[2], pout[2], perr[2];
    if (pipe2(pin, O_CLOEXEC) || pipe2(pout, O_CLOEXEC) || pipe2(perr, O_CLOEXEC)) {
        free(argv);
        send_error(id, "exec: out of file descriptors");
        return;
    }
    pid_t pid = fork();
    if (pid == 0)
        child(argv, cwd, pin[0], pout[1], perr[1]);
    free(argv);
    close(pin[0]);
    close(pout[1]);
    close(perr[1]);
    if (pid < 0) {
        close(pin[1]); close(pout[0]); close(perr[0]);
        send_error(id, "exec: fork failed");
        return;
    }
    fcntl(pin[1], F_SETFL, O_NONBLOCK);
    fcntl(pout[0], F_SETFL, O_NONBLOCK);
    fcntl(perr[0], F_SETFL, O_NONBLOCK);

    /* A pidfd becomes readable when the command exits: no polling delay. */
    int exit_fd = (int)syscall(SYS_pidfd_open, pid, 0);
    struct buf out = {0}, errb = {0};
    size_t in_off = 0;
    int in_fd = pin[1], out_open = 1, err_open = 1, status = 0, exited = 0, timed_out = 0;
    int64_t deadline = timeout_ms ? now_ms() + timeout_ms : 0;
    if (in_len == 0) {
        close(in_fd);
        in_fd = -1;
    }
    /* Until the command exits and both pipes reach end of file. A command
     * that leaves a background process holding the pipes open ends when it
     * exits: what is already in the pipes is collected, then the reply goes. */
    while (!exited || out_open || err_open) {
        struct pollfd f[4] = {{.fd = out_open ? pout[0] : -1, .events = POLLIN},
                              {.fd = err_open ? perr[0] : -1, .events = POLLIN},
                              {.fd = in_fd, .events = POLLOUT},
                              {.fd = exited ? -1 : exit_fd, .events = POLLIN}};
        int wait_ms = exit_fd >= 0 ? -1 : 50;
        if (exited)
            wait_ms = 0;
        else if (deadline && !timed_out) {
            int64_t left = deadline - now_ms();
            wait_ms = left <= 0 ? 0 : (wait_ms < 0 || left < wait_ms ? (int)left : wait_ms);
        }
        poll(f, 4, wait_ms);
        if (out_open && f[0].revents)
            out_open = drain(pout[0], &out);
        if (err_open && f[1].revents)
            err_open = drain(perr[0], &errb);
        if (in_fd >= 0 && f[2].revents) {
            ssize_t k = write(in_fd, s + in_off, in_len - in_off);
            if (k > 0)
                in_off += k;
            if ((k < 0 && errno != EAGAIN) || in_off == in_len) {
                close(in_fd);
                in_fd = -1;
            }
        }
        if (!exited) {
            pid_t w = waitpid(pid, &status, WNOHANG);
            if (w == pid)
                exited = 1;
            else if (deadline && now_ms() >= deadline) {
                kill(-pid, SIGKILL);
                kill(pid, SIGKILL);
                timed_out = 1;
            }
        } else {
            if (out_open) drain(pout[0], &out);
            if (err_open) drain(perr[0], &errb);
            break;
        }
    }
    if (in_fd >= 0)
        close(in_fd);
    if (exit_fd >= 0)
        close(exit_fd);
    close(pout[0]);
    close(perr[0]);
    reap_orphans();
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    unsigned char h[16];
    put32(h, (uint32_t)code);
    put32(h + 4, (timed_out ? EXEC_TIMED_OUT : 0) |
                 (out.truncated || errb.truncated ? EXEC_TRUNCATED : 0));
    put32(h + 8, out.len);
    put32(h + 12, errb.len);
    send_frame(T_EXEC | T_REPLY, id, h, 16, out.data, out.len, errb.data, errb.len);
    free(out.data);
    free(errb.data);
}

/* ------------------------------------------------- detach and attach */

/* Restoring the disk under a running guest: DETACH ends every process and
 * unmounts the disk, the host rewrites the image, ATTACH drops whatever the
 * guest still caches of the device and mounts it again. No reboot needed. */

static int unmount_all(void)
{
    char path[512];
    int err = 0;
    for (int i = 2; i >= 0; i--) {
        snprintf(path, sizeof path, "%s/%s", root, binds[i]);
        umount2(path, MNT_DETACH);
    }
    for (int tries = 0; umount(root) < 0; tries++) {
        if (errno == EINVAL)  /* not mounted */
            break;
        if (tries == 100) {
            err = errno;
            break;
        }
        usleep(20000);
    }
    return err;
}

static int do_detach(void)
{
    if (frozen)
        thaw_root();
    freeze_processes(0);
    /* From PID 1, kill(-1) reaches every process but this one, and every
     * orphan becomes our child: no children left means no processes left. */
    for (int tries = 0; tries < 500; tries++) {
        kill(-1, SIGKILL);
        pid_t w;
        while ((w = waitpid(-1, NULL, WNOHANG)) > 0)
            ;
        if (w < 0 && errno == ECHILD)
            break;
        usleep(2000);
    }
    sync();
    return unmount_all();
}

static int do_attach(void)
{
    char path[512], line[256];
    int fd = open(disk, O_RDONLY), err = ENODEV;
    if (fd < 0)
        return errno;
    ioctl(fd, BLKFLSBUF, 0);  /* forget cached blocks of the old contents */
    close(fd);
    FILE *fs = fopen("/proc/filesystems", "r");
    if (!fs)
        return errno;
    while (fgets(line, sizeof line, fs)) {
        if (!strncmp(line, "nodev", 5))
            continue;
        line[strcspn(line, "\n")] = 0;
        const char *type = line + strspn(line, " \t");
        if (mount(disk, root, type, 0, NULL) == 0) {
            err = 0;
            break;
        }
    }
    fclose(fs);
    if (err)
        return err;
    for (int i = 0; i < 3; i++) {
        char src[64];
        snprintf(path, sizeof path, "%s/%s", root, binds[i]);
        snprintf(src, sizeof src, "/%s", binds[i]);
        mkdir(path, 0755);
        if (mount(src, path, NULL, MS_BIND, NULL) < 0)
            return errno;
    }
    return 0;
}

/* -------------------------------------------- resuming from a checkpoint */

/* The VM runs again from a memory checkpoint (restored, or forked into a new
 * VM): its wall clock is where it stood at the checkpoint, and its random-
 * number generator is in the state every other VM resumed from that
 * checkpoint is in. Set the clock, mix the host's bytes into the entropy
 * pool and reseed, then let the disk and the processes go: none of them ran
 * in between.
 * payload: u64 realtime_ns | u32 entropy_len | u32 0 | entropy */
static int do_resume(const unsigned char *p, uint32_t len)
{
    if (len < 16)
        return EINVAL;
    uint64_t ns = get32(p) | (uint64_t)get32(p + 4) << 32;
    uint32_t n = get32(p + 8);
    if (n > len - 16 || n > 4096)
        return EINVAL;
    struct timespec ts = {.tv_sec = ns / 1000000000u, .tv_nsec = ns % 1000000000u};
    int err = clock_settime(CLOCK_REALTIME, &ts) < 0 ? errno : 0;
    int fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
    if (fd < 0 && !err)
        err = errno;
    if (fd >= 0) {
        struct rand_pool_info *info = calloc(1, sizeof *info + n + 4);
        if (info) {
            info->entropy_count = n * 8;
            info->buf_size = n;
            memcpy(info->buf, p + 16, n);
            if (ioctl(fd, RNDADDENTROPY, info) < 0 && !err)
                err = errno;
            free(info);
        } else if (!err) {
            err = ENOMEM;
        }
        if (ioctl(fd, RNDRESEEDCRNG) < 0 && !err)
            err = errno;
        close(fd);
    }
    int thawed = frozen ? thaw_root() : 0;
    int resumed = freeze_processes(0);
    return err ? err : thawed ? thawed : resumed;
}

/* ----------------------------------------------------------- shut down */

static void power_off(void)
{
    sync();
    kill(-1, SIGKILL);
    unmount_all();
    sync();
    reboot(RB_POWER_OFF);
    _exit(0);
}

/* ---------------------------------------------------------------- main */

int main(int argc, char **argv)
{
    char path[512];
    if (argc > 1)
        root = argv[1];
    if (argc > 2)
        disk = argv[2];
    signal(SIGPIPE, SIG_IGN);
    setup_cgroup();
    for (int tries = 0; !find_port(path, sizeof path); tries++) {
        if (tries == 100)
            logmsg("%s", "waiting for the virtio-serial port " PORT_NAME);
        usleep(50000);
    }
    for (;;) {
        port = open(path, O_RDWR | O_NONBLOCK | O_CLOEXEC);
        if (port >= 0)
            break;
        usleep(50000);
    }
    logmsg("ready on %s", path);

    unsigned char h[16];
    for (;;) {
        if (read_full(h, 4) < 0)
            break;
        /* Resynchronise on the magic: a host that died mid-frame leaves a
         * partial frame behind. */
        while (memcmp(h, "BDA1", 4)) {
            memmove(h, h + 1, 3);
            if (read_full(h + 3, 1) < 0)
                goto out;
        }
        if (read_full(h + 4, 12) < 0)
            break;
        int type = h[4];
        uint32_t id = get32(h + 8), len = get32(h + 12);
        if (len > MAX_PAYLOAD) {
            send_error(id, "request too large");
            continue;
        }
        unsigned char *p = malloc(len ? len : 1);
        if (!p || read_full(p, len) < 0) {
            free(p);
            send_error(id, "out of memory");
            continue;
        }
        reap_orphans();
        switch (type) {
        case T_PING:
            send_frame(T_PING | T_REPLY, id, GUESTD_VERSION, strlen(GUESTD_VERSION), NULL, 0,
                       NULL, 0);
            break;
        case T_EXEC:
            do_exec(id, p, len);
            break;
        case T_SYNC:
            send_status(T_SYNC, id, sync_root());
            break;
        case T_FREEZE: {
            /* payload: u32 auto_thaw_ms | u32 flags (FREEZE_PROCESSES) */
            int err = 0;
            thaw_deadline_ms = now_ms() + (len >= 4 ? get32(p) : 30000);
            if (len >= 8 && get32(p + 4) & FREEZE_PROCESSES)
                err = freeze_processes(1);
            if (!err)
                err = sync_root();
            if (!err)
                err = freeze_root();
            if (!err)
                frozen = 1;
            else
                freeze_processes(0);
            send_status(T_FREEZE, id, err);
            break;
        }
        case T_THAW: {
            int err = thaw_root();
            int resumed = freeze_processes(0);
            send_status(T_THAW, id, err ? err : resumed);
            break;
        }
        case T_RESUME:
            send_status(T_RESUME, id, do_resume(p, len));
            break;
        case T_DETACH:
            send_status(T_DETACH, id, do_detach());
            break;
        case T_ATTACH:
            send_status(T_ATTACH, id, do_attach());
            break;
        case T_SHUTDOWN:
            send_status(T_SHUTDOWN, id, 0);
            if (frozen)
                thaw_root();
            freeze_processes(0);
            power_off();
            break;
        default:
            send_error(id, "unknown request type");
        }
        free(p);
    }
out:
    logmsg("%s", "the port failed; powering off");
    power_off();
    return 1;
}
