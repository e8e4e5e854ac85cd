/*
 * blockdiff native core: the syscalls the engine needs, each looping in C over
 * whole arrays so that Python pays one call per operation, not one per extent.
 *
 * Conventions: every function returning int returns 0 on success and -errno on
 * failure. Array arguments are caller-owned (numpy buffers on the Python side).
 *
 * This header is also fed to cffi's cdef (preprocessor lines are dropped), so
 * it must stay plain C declarations with fixed-width types.
 */
#ifndef BLOCKDIFF_NATIVE_H
#define BLOCKDIFF_NATIVE_H

#include <stddef.h>
#include <stdint.h>

/* Extent map of [start, end) into caller arrays of `capacity` entries.
 * Loops FS_IOC_FIEMAP with large batches until the map is complete or the
 * arrays are full. *count gets the number filled; *next_start the logical
 * offset to continue from, or UINT64_MAX when the map is complete. */
int bd_fiemap(int fd, uint64_t start, uint64_t end, int sync,
              uint64_t *logical, uint64_t *physical, uint64_t *length,
              uint32_t *flags, size_t capacity, size_t *count,
              uint64_t *next_start);

/* Extent maps of n sorted, disjoint ranges [starts[i], ends[i]) (no flush
 * first), each extent cut to its range; entries cut to nothing get length 0.
 * -ENOSPC when `capacity` entries do not suffice. */
int bd_fiemap_ranges(int fd, const uint64_t *starts, const uint64_t *ends, size_t n,
                     uint64_t *logical, uint64_t *physical, uint64_t *length,
                     uint32_t *flags, size_t capacity, size_t *count);

/* Whole-file reflink of src into dst (FICLONE). */
int bd_clone_file(int dst_fd, int src_fd);

/* One FICLONERANGE call. */
int bd_clone_range(int src_fd, uint64_t src_off, uint64_t len, int dst_fd,
                   uint64_t dst_off);

/* copy_file_range loop that handles short counts; falls back to pread/pwrite
 * where the kernel refuses (EXDEV, EOPNOTSUPP, ENOSYS, EINVAL). An early EOF
 * of the source is -ENODATA. */
int bd_copy_range(int src_fd, uint64_t src_off, int dst_fd, uint64_t dst_off,
                  uint64_t len);

/* Transfer n ranges from src to dst. mode: 0 = reflink where possible (falls
 * back to copying for one range on EINVAL, for the rest on EXDEV/EOPNOTSUPP),
 * 1 = copy. If crcs is non-NULL the CRC32C of each source range is stored
 * there. dst_fd < 0 only computes the checksums. *done gets the number of
 * ranges completed, *cloned how many went by reflink. */
int bd_transfer_ranges(int src_fd, int dst_fd, const uint64_t *src_off,
                       const uint64_t *dst_off, const uint64_t *len, size_t n,
                       int mode, uint32_t *crcs, size_t *done, size_t *cloned);

/* CRC32C of every chunk-byte chunk of n ranges (a range's last chunk may be
 * shorter), one per chunk, range by range; chunk must divide 1 MiB. */
int bd_chunk_crcs(int fd, const uint64_t *off, const uint64_t *len, size_t n,
                  uint64_t chunk, uint32_t *crcs);

/* Make n ranges read as zeros: punch holes (FALLOC_FL_PUNCH_HOLE), falling
 * back to writing zeros where the filesystem cannot punch. */
int bd_zero_ranges(int fd, const uint64_t *off, const uint64_t *len, size_t n);

/* Copy a possibly sparse file: only its data segments (SEEK_DATA/SEEK_HOLE),
 * then set dst's size to size. */
int bd_copy_sparse(int src_fd, int dst_fd, uint64_t size);

/* Compare contents block by block, for filesystems with no extent sharing.
 * classes[i] for block i of the target (nblocks = ceil(target_size/block)):
 * 0 = same as base, 1 = differs and has data, 2 = differs and is all zeros.
 * Bytes past a file's size count as zeros. base_fd < 0 means "no base". */
int bd_compare_blocks(int target_fd, uint64_t target_size, int base_fd,
                      uint64_t base_size, uint32_t block, uint8_t *classes,
                      size_t nblocks);

/* Read n blocks at offsets into out (n * block bytes); past EOF reads zeros. */
int bd_read_blocks(int fd, const uint64_t *offsets, size_t n, uint32_t block,
                   uint8_t *out);

/* Share blocks between files whose bytes are equal (FIDEDUPERANGE): for
 * each range, the kernel compares src's bytes with dst's under its locks and,
 * only if they are equal, makes dst's blocks src's. same[i] is 1 where range
 * i was deduplicated whole, 0 where the bytes differed or the kernel would
 * not (a dst written meanwhile simply differs). Other errors end the call. */
int bd_dedupe_ranges(int src_fd, int dst_fd, const uint64_t *src_off,
                     const uint64_t *dst_off, const uint64_t *len, size_t n,
                     uint8_t *same);

int bd_fsync(int fd);
/* Write a file's dirty pages out and wait for them (sync_file_range over the
 * whole file): its extents are then final, without fsync's log force. */
int bd_write_out(int fd, uint64_t offset, uint64_t length);
int bd_truncate(int fd, uint64_t size);

/* statfs f_type and the fundamental block size, plus st_dev. */
int bd_fs_info(int fd, int64_t *fs_type, uint64_t *block_size, uint64_t *dev);

/* CRC32C (Castagnoli), hardware accelerated where the CPU has it. */
uint32_t bd_crc32c(uint32_t crc, const uint8_t *buf, size_t len);

#endif
