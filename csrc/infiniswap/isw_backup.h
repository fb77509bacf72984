/*
 * isw_backup.h — the device's local backup file and its background writer threads.
 *
 * Every page written to the device reaches the backup file: synchronously when its slab is
 * unmapped (or the remote failed), asynchronously after a successful remote write.  An
 * asynchronous write holds a private copy of the data in a FIFO queue; slab s always uses
 * queue s % nthreads, so all disk writes of one slab complete in submission order (thesis
 * §2.4.5).  Each slab counts writes enqueued and completed; a synchronous write or a read
 * of a slab first waits until every write enqueued before it has completed, so disk data
 * is never stale (read-after-write holds even when the remote vanished meanwhile).
 *
 * Queued bytes are bounded: each queue holds at most pending_cap / nthreads bytes (one item
 * is always admitted); producers block while a queue is full.
 */
#ifndef ISW_BACKUP_H
#define ISW_BACKUP_H

#include <stddef.h>
#include <stdint.h>

struct isw_backup;

struct isw_backup_stats {
    uint64_t pending_bytes;
    uint64_t pending_writes;
    uint64_t async_bytes;   /* completed asynchronous writes */
    uint64_t async_writes;
    uint64_t errors;        /* failed asynchronous writes */
};

int isw_backup_open(const char *path, uint64_t size, uint32_t nslabs, int nthreads,
                    uint64_t pending_cap, struct isw_backup **out);
/* Copy buf and queue its write at device offset off (slab `slab`); may block on the cap. */
int isw_backup_write_async(struct isw_backup *b, uint32_t slab, uint64_t off, const void *buf,
                           size_t len);
/* Write now, after every pending write of that slab. */
int isw_backup_write_sync(struct isw_backup *b, uint32_t slab, uint64_t off, const void *buf,
                          size_t len);
/* Read, after every pending write of that slab. */
int isw_backup_read(struct isw_backup *b, uint32_t slab, uint64_t off, void *buf, size_t len);
/* Wait for every write queued so far, then fdatasync.  Reports the first failed
 * asynchronous write (sticky). */
int isw_backup_flush(struct isw_backup *b);
/* Drain the queues, stop the writers, close the file.  Returns the flush result. */
int isw_backup_close(struct isw_backup *b);
void isw_backup_set_delay_us(struct isw_backup *b, uint32_t us);
void isw_backup_get_stats(struct isw_backup *b, struct isw_backup_stats *out);
uint64_t isw_backup_slab_pending(struct isw_backup *b, uint32_t slab);
uint64_t isw_backup_slab_async_bytes(struct isw_backup *b, uint32_t slab);

#endif
