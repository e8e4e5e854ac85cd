/*
 * floor: the kernel floor for a block-level reflink diff.
 *
 * Does the same work as `blockdiff create` / `blockdiff apply` using nothing
 * but system calls, so the benchmark can show how far the real tool is from
 * the cost of the ioctls themselves.
 *
 *   floor create TARGET BASE OUT
 *       fsync(TARGET); FIEMAP TARGET and BASE in large batches; walk both
 *       maps to find the ranges where TARGET differs from BASE; write a
 *       one-block header to OUT, then one FICLONERANGE per changed data
 *       range into OUT, back to back at block aligned offsets; write the
 *       range table to OUT.ranges; fsync both.
 *
 *   floor apply OUT BASE RESTORED
 *       FICLONE BASE into RESTORED, truncate to the target size, one
 *       FICLONERANGE per data range from OUT, one hole punch per range that
 *       became a hole, fsync.
 *
 * Both print one JSON object with timings on stdout.
 *
 * A range is "changed" at logical offset x when
 *   - TARGET has data at x and BASE has a hole or unwritten extent at x, or
 *     data at a different physical address;                 -> data range
 *   - TARGET has a hole or unwritten extent at x and BASE has data at x.
 *                                                            -> zero range
 * Everything past the end of BASE counts as a hole in BASE.
 *
 * Build: cc -O2 -o floor floor.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/falloc.h>
#include <linux/fiemap.h>
#include <linux/fs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <time.h>
#include <unistd.h>

#define BATCH 65536u
#define HEADER_SIZE 4096u
#define MAGIC "BDFLOOR1"

enum { K_HOLE = 0, K_DATA = 1 };

struct ext {
    uint64_t logical, physical, length;
    int data; /* 1: real written data, 0: unwritten (reads as zeros) */
};

struct extmap {
    struct ext *v;
    size_t n, cap;
    uint64_t ioctls;
    uint64_t raw; /* extents as reported by FIEMAP, before merging */
};

/* One entry of the range table. out_off == UINT64_MAX marks a zero range. */
struct range {
    uint64_t logical, length, out_off;
};

struct rangevec {
    struct range *v;
    size_t n, cap;
};

struct table_header {
    char magic[8];
    uint64_t target_size;
    uint64_t nranges;
    uint64_t data_bytes;
};

static void die(const char *what, const char *path)
{
    fprintf(stderr, "floor: %s%s%s: %s\n", what, path ? " " : "", path ? path : "",
            strerror(errno));
    exit(1);
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *xrealloc(void *p, size_t n)
{
    void *q = realloc(p, n);
    if (!q) {
        fprintf(stderr, "floor: out of memory\n");
        exit(1);
    }
    return q;
}

static void push_ext(struct extmap *m, const struct ext *e)
{
    /* merge with the previous extent when logically and physically adjacent */
    if (m->n) {
        struct ext *p = &m->v[m->n - 1];
        if (p->data == e->data && p->logical + p->length == e->logical &&
            p->physical + p->length == e->physical) {
            p->length += e->length;
            return;
        }
    }
    if (m->n == m->cap) {
        m->cap = m->cap ? m->cap * 2 : 1024;
        m->v = xrealloc(m->v, m->cap * sizeof *m->v);
    }
    m->v[m->n++] = *e;
}

/* Read the whole extent map of fd, BATCH extents per ioctl. */
static void read_map(int fd, const char *path, struct extmap *m)
{
    size_t sz = sizeof(struct fiemap) + BATCH * sizeof(struct fiemap_extent);
    struct fiemap *fm = malloc(sz);
    uint64_t start = 0;
    int last = 0;

    if (!fm)
        die("malloc", NULL);
    while (!last) {
        memset(fm, 0, sizeof *fm);
        fm->fm_start = start;
        fm->fm_length = FIEMAP_MAX_OFFSET - start;
        fm->fm_flags = 0;
        fm->fm_extent_count = BATCH;
        if (ioctl(fd, FS_IOC_FIEMAP, fm) < 0)
            die("FS_IOC_FIEMAP", path);
        m->ioctls++;
        if (fm->fm_mapped_extents == 0)
            break;
        for (uint32_t i = 0; i < fm->fm_mapped_extents; i++) {
            struct fiemap_extent *fe = &fm->fm_extents[i];
            struct ext e;
            m->raw++;
            e.logical = fe->fe_logical;
            e.physical = fe->fe_physical;
            e.length = fe->fe_length;
            /* Delayed allocation or unknown location: cannot be shared, count
             * it as data with a physical address nothing else can have. */
            if (fe->fe_flags & (FIEMAP_EXTENT_DELALLOC | FIEMAP_EXTENT_UNKNOWN))
                e.physical = UINT64_MAX - e.logical;
            e.data = !(fe->fe_flags & FIEMAP_EXTENT_UNWRITTEN);
            push_ext(m, &e);
            if (fe->fe_flags & FIEMAP_EXTENT_LAST)
                last = 1;
            start = fe->fe_logical + fe->fe_length;
        }
    }
    free(fm);
}

static void push_range(struct rangevec *r, uint64_t off, uint64_t len, int kind)
{
    uint64_t tag = kind == K_DATA ? 0 : UINT64_MAX;
    if (r->n) {
        struct range *p = &r->v[r->n - 1];
        if (p->logical + p->length == off && (p->out_off == UINT64_MAX) == (tag == UINT64_MAX)) {
            p->length += len;
            return;
        }
    }
    if (r->n == r->cap) {
        r->cap = r->cap ? r->cap * 2 : 1024;
        r->v = xrealloc(r->v, r->cap * sizeof *r->v);
    }
    r->v[r->n].logical = off;
    r->v[r->n].length = len;
    r->v[r->n].out_off = tag;
    r->n++;
}

/*
 * State of a map at offset pos: sets *kind (0 hole, 1 unwritten, 2 data),
 * *delta (physical - logical for data) and returns the end of that state.
 * *idx is advanced monotonically.
 */
static uint64_t state_at(const struct extmap *m, size_t *idx, uint64_t pos, uint64_t limit,
                         int *kind, uint64_t *delta)
{
    while (*idx < m->n && m->v[*idx].logical + m->v[*idx].length <= pos)
        (*idx)++;
    if (pos >= limit) {
        *kind = 0;
        return UINT64_MAX;
    }
    if (*idx == m->n) {
        *kind = 0;
        return limit;
    }
    const struct ext *e = &m->v[*idx];
    if (e->logical > pos) {
        *kind = 0;
        return e->logical < limit ? e->logical : limit;
    }
    *kind = e->data ? 2 : 1;
    *delta = e->physical - e->logical;
    uint64_t end = e->logical + e->length;
    return end < limit ? end : limit;
}

static void changed_ranges(const struct extmap *t, uint64_t tsize, const struct extmap *b,
                           uint64_t bsize, struct rangevec *out)
{
    size_t ti = 0, bi = 0;
    uint64_t pos = 0;
    while (pos < tsize) {
        int tk, bk;
        uint64_t td = 0, bd = 0;
        uint64_t tend = state_at(t, &ti, pos, tsize, &tk, &td);
        uint64_t bend = state_at(b, &bi, pos, bsize, &bk, &bd);
        uint64_t end = tend < bend ? tend : bend;
        if (end > tsize)
            end = tsize;
        if (tk == 2) {
            if (bk != 2 || td != bd)
                push_range(out, pos, end - pos, K_DATA);
        } else if (bk == 2) {
            push_range(out, pos, end - pos, K_HOLE);
        }
        pos = end;
    }
}

static uint64_t block_size(int fd, const char *path)
{
    struct statfs sfs;
    if (fstatfs(fd, &sfs) < 0)
        die("fstatfs", path);
    return (uint64_t)sfs.f_bsize;
}

static void write_all(int fd, const void *buf, size_t len, off_t off, const char *path)
{
    const char *p = buf;
    while (len) {
        ssize_t w = pwrite(fd, p, len, off);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            die("pwrite", path);
        }
        p += w;
        len -= (size_t)w;
        off += w;
    }
}

static void read_all(int fd, void *buf, size_t len, off_t off, const char *path)
{
    char *p = buf;
    while (len) {
        ssize_t r = pread(fd, p, len, off);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            die("pread", path);
        }
        if (r == 0) {
            errno = EIO;
            die("short read", path);
        }
        p += r;
        len -= (size_t)r;
        off += r;
    }
}

static char *ranges_path(const char *out)
{
    size_t n = strlen(out);
    char *p = malloc(n + sizeof ".ranges");
    if (!p)
        die("malloc", NULL);
    memcpy(p, out, n);
    memcpy(p + n, ".ranges", sizeof ".ranges");
    return p;
}

static int cmd_create(const char *target, const char *base, const char *out)
{
    struct extmap tm = {0}, bm = {0};
    struct rangevec rv = {0};
    struct stat tst, bst;
    double t0 = now();

    int tfd = open(target, O_RDONLY);
    if (tfd < 0)
        die("open", target);
    int bfd = open(base, O_RDONLY);
    if (bfd < 0)
        die("open", base);
    if (fsync(tfd) < 0)
        die("fsync", target);
    if (fstat(tfd, &tst) < 0)
        die("fstat", target);
    if (fstat(bfd, &bst) < 0)
        die("fstat", base);
    double t1 = now();

    read_map(tfd, target, &tm);
    read_map(bfd, base, &bm);
    double t2 = now();

    changed_ranges(&tm, (uint64_t)tst.st_size, &bm, (uint64_t)bst.st_size, &rv);
    double t3 = now();

    int ofd = open(out, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (ofd < 0)
        die("open", out);
    uint64_t bs = block_size(ofd, out);
    uint64_t hdr = HEADER_SIZE > bs ? HEADER_SIZE : bs;
    uint64_t off = hdr, data_bytes = 0, nclone = 0, nzero = 0;

    char *header = calloc(1, hdr);
    if (!header)
        die("calloc", NULL);
    struct table_header th;
    memcpy(th.magic, MAGIC, 8);
    th.target_size = (uint64_t)tst.st_size;
    th.nranges = rv.n;
    th.data_bytes = 0;
    for (size_t i = 0; i < rv.n; i++)
        if (rv.v[i].out_off != UINT64_MAX)
            th.data_bytes += rv.v[i].length;
    memcpy(header, &th, sizeof th);
    write_all(ofd, header, hdr, 0, out);
    free(header);
    double t4 = now();

    for (size_t i = 0; i < rv.n; i++) {
        struct range *r = &rv.v[i];
        if (r->out_off == UINT64_MAX) {
            nzero++;
            continue;
        }
        struct file_clone_range fcr = {
            .src_fd = tfd,
            .src_offset = r->logical,
            .src_length = r->length,
            .dest_offset = off,
        };
        if (ioctl(ofd, FICLONERANGE, &fcr) < 0)
            die("FICLONERANGE into", out);
        r->out_off = off;
        off += (r->length + bs - 1) / bs * bs;
        data_bytes += r->length;
        nclone++;
    }
    double t5 = now();

    char *rp = ranges_path(out);
    int rfd = open(rp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (rfd < 0)
        die("open", rp);
    write_all(rfd, &th, sizeof th, 0, rp);
    write_all(rfd, rv.v, rv.n * sizeof *rv.v, sizeof th, rp);
    double t6 = now();

    if (fsync(ofd) < 0)
        die("fsync", out);
    if (fsync(rfd) < 0)
        die("fsync", rp);
    close(rfd);
    close(ofd);
    close(tfd);
    close(bfd);
    double t7 = now();

    printf("{\"op\": \"create\", \"fsync_target_s\": %.6f, \"fiemap_s\": %.6f, "
           "\"merge_s\": %.6f, \"header_s\": %.6f, \"clone_s\": %.6f, \"table_s\": %.6f, "
           "\"fsync_out_s\": %.6f, \"total_s\": %.6f, \"ranges\": %zu, "
           "\"clone_ranges\": %" PRIu64 ", \"zero_ranges\": %" PRIu64 ", "
           "\"data_bytes\": %" PRIu64 ", \"extents_target\": %" PRIu64 ", "
           "\"extents_base\": %" PRIu64 ", "
           "\"fiemap_ioctls\": %" PRIu64 ", \"block_size\": %" PRIu64 ", "
           "\"target_size\": %" PRIu64 "}\n",
           t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6, t7 - t0, rv.n,
           nclone, nzero, data_bytes, tm.raw, bm.raw, tm.ioctls + bm.ioctls, bs,
           (uint64_t)tst.st_size);
    free(rp);
    free(tm.v);
    free(bm.v);
    free(rv.v);
    return 0;
}

static int cmd_apply(const char *out, const char *base, const char *restored)
{
    double t0 = now();
    char *rp = ranges_path(out);
    int rfd = open(rp, O_RDONLY | O_CLOEXEC);
    if (rfd < 0)
        die("open", rp);
    struct table_header th;
    read_all(rfd, &th, sizeof th, 0, rp);
    if (memcmp(th.magic, MAGIC, 8) != 0) {
        errno = EINVAL;
        die("bad range table", rp);
    }
    struct range *rv = malloc(th.nranges ? th.nranges * sizeof *rv : 1);
    if (!rv)
        die("malloc", NULL);
    read_all(rfd, rv, th.nranges * sizeof *rv, sizeof th, rp);
    close(rfd);

    int ofd = open(out, O_RDONLY | O_CLOEXEC);
    if (ofd < 0)
        die("open", out);
    int bfd = open(base, O_RDONLY | O_CLOEXEC);
    if (bfd < 0)
        die("open", base);
    int dfd = open(restored, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (dfd < 0)
        die("open", restored);
    double t1 = now();

    if (ioctl(dfd, FICLONE, bfd) < 0)
        die("FICLONE into", restored);
    if (ftruncate(dfd, (off_t)th.target_size) < 0)
        die("ftruncate", restored);
    double t2 = now();

    uint64_t nclone = 0, nzero = 0;
    for (uint64_t i = 0; i < th.nranges; i++) {
        struct range *r = &rv[i];
        if (r->out_off == UINT64_MAX) {
            if (fallocate(dfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)r->logical,
                          (off_t)r->length) < 0)
                die("fallocate punch hole", restored);
            nzero++;
            continue;
        }
        struct file_clone_range fcr = {
            .src_fd = ofd,
            .src_offset = r->out_off,
            .src_length = r->length,
            .dest_offset = r->logical,
        };
        if (ioctl(dfd, FICLONERANGE, &fcr) < 0)
            die("FICLONERANGE into", restored);
        nclone++;
    }
    double t3 = now();

    if (fsync(dfd) < 0)
        die("fsync", restored);
    close(dfd);
    close(bfd);
    close(ofd);
    double t4 = now();

    printf("{\"op\": \"apply\", \"read_table_s\": %.6f, \"clone_base_s\": %.6f, "
           "\"clone_s\": %.6f, \"fsync_s\": %.6f, \"total_s\": %.6f, "
           "\"ranges\": %" PRIu64 ", \"clone_ranges\": %" PRIu64 ", "
           "\"zero_ranges\": %" PRIu64 ", \"data_bytes\": %" PRIu64 "}\n",
           t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0, th.nranges, nclone, nzero,
           th.data_bytes);
    free(rv);
    free(rp);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 5 && strcmp(argv[1], "create") == 0)
        return cmd_create(argv[2], argv[3], argv[4]);
    if (argc == 5 && strcmp(argv[1], "apply") == 0)
        return cmd_apply(argv[2], argv[3], argv[4]);
    fprintf(stderr, "usage: floor create TARGET BASE OUT\n"
                    "       floor apply OUT BASE RESTORED\n");
    return 2;
}
