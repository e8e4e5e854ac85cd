/*
 * blockdiff native core. See native.h for the contract of each function.
 *
 * Everything here loops over whole arrays in C: the engine's cost should be
 * the syscalls themselves, with nothing per extent in the interpreter.
 */
#define _GNU_SOURCE
#include "native.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <linux/fiemap.h>
#include <linux/fs.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

/* Extents per FIEMAP ioctl: large enough that a million-extent map takes a few
 * dozen calls, small enough that the kernel buffer stays under 2 MiB. */
#define FIEMAP_BATCH 32768
/* Buffer for copies and checksums that go through user space. */
#define COPY_BUFFER (1u << 20)

/* ------------------------------------------------------------------ */
/* CRC32C                                                              */

static uint32_t crc_table[256];
static int crc_hw;

__attribute__((constructor)) static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_table[i] = c;
    }
#if defined(__x86_64__)
    __builtin_cpu_init();
    crc_hw = __builtin_cpu_supports("sse4.2");
#endif
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t
crc32c_sse42(uint32_t crc, const uint8_t *p, size_t n)
{
    uint64_t c = crc;
    while (n && ((uintptr_t)p & 7)) {
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
        n--;
    }
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = __builtin_ia32_crc32di(c, v);
        p += 8;
        n -= 8;
    }
    while (n--)
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
    return (uint32_t)c;
}
#endif

uint32_t bd_crc32c(uint32_t crc, const uint8_t *buf, size_t len)
{
    crc = ~crc;
#if defined(__x86_64__)
    if (crc_hw)
        return ~crc32c_sse42(crc, buf, len);
#endif
    while (len--)
        crc = crc_table[(crc ^ *buf++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

/* ------------------------------------------------------------------ */
/* Small I/O helpers                                                   */

/* Read len bytes at off. Past EOF: zeros if pad_eof (a file's size need not be
 * a multiple of the block size), else -ENODATA (the file is shorter than its
 * caller was told). */
static int read_at(int fd, uint8_t *buf, size_t len, uint64_t off, int pad_eof)
{
    size_t got = 0;
    while (got < len) {
        ssize_t r = pread(fd, buf + got, len - got, (off_t)(off + got));
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (r == 0) {
            if (!pad_eof)
                return -ENODATA;
            memset(buf + got, 0, len - got);
            break;
        }
        got += (size_t)r;
    }
    return 0;
}

static int write_full(int fd, const uint8_t *buf, size_t len, uint64_t off)
{
    size_t put = 0;
    while (put < len) {
        ssize_t r = pwrite(fd, buf + put, len - put, (off_t)(off + put));
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (r == 0)
            return -EIO;
        put += (size_t)r;
    }
    return 0;
}

static int is_zero(const uint8_t *p, size_t n)
{
    return n == 0 || (p[0] == 0 && memcmp(p, p + 1, n - 1) == 0);
}

/* Ask the kernel to start reading ranges we are about to read, so that cold
 * scattered blocks are fetched with many requests in flight instead of one
 * at a time. Advisory: errors are ignored. */
#define PREFETCH_WINDOW (64u << 20)

static void prefetch(int fd, const uint64_t *off, const uint64_t *len,
                     size_t n, uint64_t fixed_len)
{
    for (size_t i = 0; i < n; i++)
        posix_fadvise(fd, (off_t)off[i], (off_t)(len ? len[i] : fixed_len),
                      POSIX_FADV_WILLNEED);
}

/* Prefetch the window of ranges that starts at range i (PREFETCH_WINDOW
 * bytes, at least one range); returns the index of the first range after it. */
static size_t prefetch_window(int fd, const uint64_t *off, const uint64_t *len,
                              size_t n, size_t i)
{
    uint64_t bytes = 0;
    size_t j = i;
    while (j < n && (bytes < PREFETCH_WINDOW || j == i))
        bytes += len[j++];
    prefetch(fd, off + i, len + i, j - i, 0);
    return j;
}

/* Copy through a user-space buffer, optionally checksumming on the way. With
 * dst_fd < 0 it only checksums. */
static int copy_buffered(int src_fd, uint64_t src_off, int dst_fd,
                         uint64_t dst_off, uint64_t len, uint8_t *buf,
                         uint32_t *crc)
{
    uint32_t c = 0;
    while (len) {
        size_t chunk = len < COPY_BUFFER ? (size_t)len : COPY_BUFFER;
        int r = read_at(src_fd, buf, chunk, src_off, 0);
        if (r)
            return r;
        if (crc)
            c = bd_crc32c(c, buf, chunk);
        if (dst_fd >= 0 && (r = write_full(dst_fd, buf, chunk, dst_off)))
            return r;
        src_off += chunk;
        dst_off += chunk;
        len -= chunk;
    }
    if (crc)
        *crc = c;
    return 0;
}

/* CRC32C of every chunk of n ranges: each range is cut into chunks of
 * `chunk` bytes (its last one shorter), read a buffer at a time, with the
 * next window of ranges prefetched. crcs gets one value per chunk, range by
 * range. chunk must divide COPY_BUFFER. */
int bd_chunk_crcs(int fd, const uint64_t *off, const uint64_t *len, size_t n,
                  uint64_t chunk, uint32_t *crcs)
{
    if (chunk == 0 || COPY_BUFFER % chunk)
        return -EINVAL;
    uint8_t *buf = malloc(COPY_BUFFER);
    if (!buf)
        return -ENOMEM;
    int rc = 0;
    size_t out = 0, prefetched = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        if (i == prefetched)
            prefetched = prefetch_window(fd, off, len, n, i);
        uint64_t at = off[i], left = len[i];
        while (left) {
            size_t step = left < COPY_BUFFER ? (size_t)left : COPY_BUFFER;
            if ((rc = read_at(fd, buf, step, at, 0)))
                break;
            for (size_t k = 0; k < step; k += chunk) {
                size_t part = step - k < chunk ? step - k : (size_t)chunk;
                crcs[out++] = bd_crc32c(0, buf + k, part);
            }
            at += step;
            left -= step;
        }
    }
    free(buf);
    return rc;
}

static int refused_by_kernel(int err)
{
    return err == EXDEV || err == EOPNOTSUPP || err == ENOSYS ||
           err == EINVAL || err == ENOTTY;
}

/* ------------------------------------------------------------------ */
/* FIEMAP                                                              */

int bd_fiemap(int fd, uint64_t start, uint64_t end, int sync,
              uint64_t *logical, uint64_t *physical, uint64_t *length,
              uint32_t *flags, size_t capacity, size_t *count,
              uint64_t *next_start)
{
    *count = 0;
    *next_start = UINT64_MAX;
    if (start >= end)
        return 0;
    if (capacity == 0)
        return -EINVAL;
    size_t batch = capacity < FIEMAP_BATCH ? capacity : FIEMAP_BATCH;
    struct fiemap *fm =
        malloc(sizeof(*fm) + batch * sizeof(struct fiemap_extent));
    if (!fm)
        return -ENOMEM;

    size_t filled = 0;
    uint64_t pos = start;
    int first = 1;
    while (filled < capacity) {
        size_t want = capacity - filled;
        if (want > batch)
            want = batch;
        memset(fm, 0, sizeof(*fm));
        fm->fm_start = pos;
        fm->fm_length = end - pos;
        /* Sync once: later batches see the same flushed state. */
        fm->fm_flags = (sync && first) ? FIEMAP_FLAG_SYNC : 0;
        fm->fm_extent_count = (uint32_t)want;
        if (ioctl(fd, FS_IOC_FIEMAP, fm) < 0) {
            int e = errno;
            free(fm);
            return -e;
        }
        first = 0;
        uint32_t got = fm->fm_mapped_extents;
        int last = 0;
        for (uint32_t i = 0; i < got; i++) {
            const struct fiemap_extent *fe = &fm->fm_extents[i];
            logical[filled] = fe->fe_logical;
            physical[filled] = fe->fe_physical;
            length[filled] = fe->fe_length;
            flags[filled] = fe->fe_flags;
            filled++;
            if (fe->fe_flags & FIEMAP_EXTENT_LAST)
                last = 1;
        }
        if (got == 0 || got < want || last) {
            pos = UINT64_MAX;
            break;
        }
        const struct fiemap_extent *tail = &fm->fm_extents[got - 1];
        uint64_t tail_end = tail->fe_logical + tail->fe_length;
        if (tail_end >= end) {
            pos = UINT64_MAX;
            break;
        }
        if (tail_end <= pos) { /* no progress: never loop forever */
            free(fm);
            return -EIO;
        }
        pos = tail_end;
    }
    free(fm);
    *count = filled;
    *next_start = pos;
    return 0;
}

int bd_fiemap_ranges(int fd, const uint64_t *starts, const uint64_t *ends, size_t n,
                     uint64_t *logical, uint64_t *physical, uint64_t *length,
                     uint32_t *flags, size_t capacity, size_t *count)
{
    size_t filled = 0;
    *count = 0;
    for (size_t r = 0; r < n; r++) {
        size_t got;
        uint64_t next;
        if (filled == capacity)
            return -ENOSPC;
        int rc = bd_fiemap(fd, starts[r], ends[r], 0, logical + filled,
                           physical + filled, length + filled, flags + filled,
                           capacity - filled, &got, &next);
        if (rc < 0)
            return rc;
        if (next != UINT64_MAX)
            return -ENOSPC;
        /* Extents crossing the range's bounds are cut to it, physical
         * addresses moved along, so ranges never overlap in the output. */
        for (size_t i = filled; i < filled + got; i++) {
            uint64_t lo = logical[i] > starts[r] ? logical[i] : starts[r];
            uint64_t end = logical[i] + length[i];
            uint64_t hi = end < ends[r] ? end : ends[r];
            if (hi <= lo) {
                length[i] = 0;
                continue;
            }
            physical[i] += lo - logical[i];
            logical[i] = lo;
            length[i] = hi - lo;
        }
        filled += got;
    }
    *count = filled;
    return 0;
}

/* ------------------------------------------------------------------ */
/* Reflink and copy                                                    */

int bd_clone_file(int dst_fd, int src_fd)
{
    return ioctl(dst_fd, FICLONE, src_fd) < 0 ? -errno : 0;
}

int bd_clone_range(int src_fd, uint64_t src_off, uint64_t len, int dst_fd,
                   uint64_t dst_off)
{
    /* FICLONERANGE reads length 0 as "to EOF": never pass it through. */
    if (len == 0)
        return 0;
    struct file_clone_range arg = {
        .src_fd = src_fd,
        .src_offset = src_off,
        .src_length = len,
        .dest_offset = dst_off,
    };
    return ioctl(dst_fd, FICLONERANGE, &arg) < 0 ? -errno : 0;
}

int bd_dedupe_ranges(int src_fd, int dst_fd, const uint64_t *src_off,
                     const uint64_t *dst_off, const uint64_t *len, size_t n,
                     uint8_t *same)
{
    struct {
        struct file_dedupe_range range;
        struct file_dedupe_range_info info;
    } arg;
    for (size_t i = 0; i < n; i++) {
        same[i] = 0;
        uint64_t done = 0;
        /* The kernel may dedupe less than asked (it caps one call's length):
         * go on from where it stopped. */
        while (done < len[i]) {
            memset(&arg, 0, sizeof arg);
            arg.range.src_offset = src_off[i] + done;
            arg.range.src_length = len[i] - done;
            arg.range.dest_count = 1;
            arg.info.dest_fd = dst_fd;
            arg.info.dest_offset = dst_off[i] + done;
            if (ioctl(src_fd, FIDEDUPERANGE, &arg) < 0) {
                int e = errno;
                /* Not for these files (no reflink, another filesystem, not
                 * allowed): nothing shared, nothing wrong. */
                if (e == EOPNOTSUPP || e == EINVAL || e == EXDEV || e == EPERM ||
                    e == ETXTBSY || e == EISDIR)
                    break;
                return -e;
            }
            if (arg.info.status != FILE_DEDUPE_RANGE_SAME || arg.info.bytes_deduped == 0)
                break;
            done += arg.info.bytes_deduped;
        }
        same[i] = done >= len[i];
    }
    return 0;
}

int bd_copy_range(int src_fd, uint64_t src_off, int dst_fd, uint64_t dst_off,
                  uint64_t len)
{
    while (len) {
        loff_t in = (loff_t)src_off, out = (loff_t)dst_off;
        ssize_t r = copy_file_range(src_fd, &in, dst_fd, &out, len, 0);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (!refused_by_kernel(errno))
                return -errno;
            uint8_t *buf = malloc(COPY_BUFFER);
            if (!buf)
                return -ENOMEM;
            int rc = copy_buffered(src_fd, src_off, dst_fd, dst_off, len, buf,
                                   NULL);
            free(buf);
            return rc;
        }
        if (r == 0)
            return -ENODATA;
        src_off += (uint64_t)r;
        dst_off += (uint64_t)r;
        len -= (uint64_t)r;
    }
    return 0;
}

int bd_transfer_ranges(int src_fd, int dst_fd, const uint64_t *src_off,
                       const uint64_t *dst_off, const uint64_t *len, size_t n,
                       int mode, uint32_t *crcs, size_t *done, size_t *cloned)
{
    uint8_t *buf = NULL;
    int rc = 0;
    *done = 0;
    *cloned = 0;
    if (crcs || mode != 0 || dst_fd < 0) {
        buf = malloc(COPY_BUFFER);
        if (!buf)
            return -ENOMEM;
    }
    size_t prefetched = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t so = src_off[i], l = len[i];
        uint64_t dof = dst_off ? dst_off[i] : 0;
        if (buf && i == prefetched)   /* the next window of ranges we will read */
            prefetched = prefetch_window(src_fd, src_off, len, n, i);
        if (dst_fd < 0 || (mode == 0 && crcs)) {
            /* Checksums need the bytes; reading them also catches a source
             * shorter than its range table says. */
            if ((rc = copy_buffered(src_fd, so, -1, 0, l, buf,
                                    crcs ? &crcs[i] : NULL)))
                goto out;
            if (dst_fd < 0) {
                (*done)++;
                continue;
            }
        }
        if (mode == 0) {
            rc = bd_clone_range(src_fd, so, l, dst_fd, dof);
            if (rc == 0) {
                (*done)++;
                (*cloned)++;
                continue;
            }
            /* EINVAL: this range is unaligned; copy it and keep cloning the
             * rest. Other refusals mean no reflink between these files. */
            if (rc != -EINVAL) {
                if (!refused_by_kernel(-rc))
                    goto out;
                mode = 1;
                if (!buf && !(buf = malloc(COPY_BUFFER))) {
                    rc = -ENOMEM;
                    goto out;
                }
            }
            if ((rc = bd_copy_range(src_fd, so, dst_fd, dof, l)))
                goto out;
            (*done)++;
            continue;
        }
        if (crcs)
            rc = copy_buffered(src_fd, so, dst_fd, dof, l, buf, &crcs[i]);
        else
            rc = bd_copy_range(src_fd, so, dst_fd, dof, l);
        if (rc)
            goto out;
        (*done)++;
    }
out:
    free(buf);
    return rc;
}

int bd_zero_ranges(int fd, const uint64_t *off, const uint64_t *len, size_t n)
{
    uint8_t *zeros = NULL;
    for (size_t i = 0; i < n; i++) {
        if (len[i] == 0)
            continue;
        if (!zeros && fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                (off_t)off[i], (off_t)len[i]) == 0)
            continue;
        if (!zeros) {
            if (errno != EOPNOTSUPP)
                return -errno;
            if (!(zeros = calloc(1, COPY_BUFFER)))
                return -ENOMEM;
        }
        for (uint64_t done = 0; done < len[i];) {
            uint64_t chunk = len[i] - done;
            if (chunk > COPY_BUFFER)
                chunk = COPY_BUFFER;
            int rc = write_full(fd, zeros, (size_t)chunk, off[i] + done);
            if (rc) {
                free(zeros);
                return rc;
            }
            done += chunk;
        }
    }
    free(zeros);
    return 0;
}

int bd_copy_sparse(int src_fd, int dst_fd, uint64_t size)
{
    uint64_t pos = 0;
    while (pos < size) {
        off_t data = lseek(src_fd, (off_t)pos, SEEK_DATA);
        if (data < 0) {
            if (errno == ENXIO)
                break; /* only a hole remains */
            return -errno;
        }
        if ((uint64_t)data >= size)
            break;
        off_t hole = lseek(src_fd, data, SEEK_HOLE);
        if (hole < 0)
            return -errno;
        uint64_t end = (uint64_t)hole < size ? (uint64_t)hole : size;
        int rc = bd_copy_range(src_fd, (uint64_t)data, dst_fd, (uint64_t)data,
                               end - (uint64_t)data);
        if (rc)
            return rc;
        pos = end;
    }
    return ftruncate(dst_fd, (off_t)size) < 0 ? -errno : 0;
}

/* ------------------------------------------------------------------ */
/* Content comparison (filesystems without shared extents)             */

int bd_compare_blocks(int target_fd, uint64_t target_size, int base_fd,
                      uint64_t base_size, uint32_t block, uint8_t *classes,
                      size_t nblocks)
{
    if (block == 0 || COPY_BUFFER % block)
        return -EINVAL;
    uint8_t *t = malloc(COPY_BUFFER), *b = malloc(COPY_BUFFER);
    int rc = 0;
    if (!t || !b) {
        rc = -ENOMEM;
        goto out;
    }
    size_t per_chunk = COPY_BUFFER / block;
    for (size_t first = 0; first < nblocks; first += per_chunk) {
        size_t count = nblocks - first < per_chunk ? nblocks - first : per_chunk;
        uint64_t off = (uint64_t)first * block;
        size_t bytes = count * block;
        /* read_at zero-fills past EOF: bytes past a file's size count as
         * zeros, as the apply side's truncate will make them. */
        if ((rc = read_at(target_fd, t, bytes, off, 1)))
            goto out;
        int have_base = base_fd >= 0 && off < base_size;
        if (have_base && (rc = read_at(base_fd, b, bytes, off, 1)))
            goto out;
        for (size_t i = 0; i < count; i++) {
            const uint8_t *tb = t + i * block, *bb = b + i * block;
            int tz = is_zero(tb, block);
            if (!have_base || (uint64_t)(first + i) * block >= base_size) {
                classes[first + i] = tz ? 0 : 1;
            } else if (memcmp(tb, bb, block) == 0) {
                classes[first + i] = 0;
            } else {
                classes[first + i] = tz ? 2 : 1;
            }
        }
    }
out:
    free(t);
    free(b);
    return rc;
}

int bd_read_blocks(int fd, const uint64_t *offsets, size_t n, uint32_t block,
                   uint8_t *out)
{
    prefetch(fd, offsets, NULL, n, block);
    for (size_t i = 0; i < n; i++) {
        int rc = read_at(fd, out + i * (size_t)block, block, offsets[i], 1);
        if (rc)
            return rc;
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* Misc                                                                */

int bd_fsync(int fd) { return fsync(fd) < 0 ? -errno : 0; }

int bd_write_out(int fd, uint64_t offset, uint64_t length)
{
    unsigned flags = SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                     SYNC_FILE_RANGE_WAIT_AFTER;
    return sync_file_range(fd, (off_t)offset, (off_t)length, flags) < 0 ? -errno : 0;
}

int bd_truncate(int fd, uint64_t size)
{
    return ftruncate(fd, (off_t)size) < 0 ? -errno : 0;
}

int bd_fs_info(int fd, int64_t *fs_type, uint64_t *block_size, uint64_t *dev)
{
    struct statfs sf;
    struct stat st;
    if (fstatfs(fd, &sf) < 0 || fstat(fd, &st) < 0)
        return -errno;
    *fs_type = (int64_t)sf.f_type;
    *block_size = (uint64_t)sf.f_bsize;
    *dev = (uint64_t)st.st_dev;
    return 0;
}
