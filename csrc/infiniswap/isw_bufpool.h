/*
 * isw_bufpool.h — a pool of preallocated I/O buffers, one per thread that asks.
 *
 * Owns: the buffers (mapped, pre-faulted and, where permitted, mlocked up front, so a
 * thread on the paging path never allocates) and the thread-specific key that binds a
 * buffer to the thread using it.  A thread takes a buffer at its first call of
 * isw_bufpool_thread_buffer() and keeps it; the key's destructor gives it back when the
 * thread exits.  Should more threads than buffers ever ask, the extra one maps its own
 * (freed when it exits).
 *
 * Used by the FUSE server (isw_fuse.c) for its worker threads' request buffers.
 */
#ifndef ISW_BUFPOOL_H
#define ISW_BUFPOOL_H

#include <stddef.h>

struct isw_bufpool;

/* Map nbufs buffers of size bytes each.  0, or -errno with a message in isw_last_error(). */
int isw_bufpool_create(int nbufs, size_t size, struct isw_bufpool **out);
/* The calling thread's buffer (size bytes); NULL only if the pool is empty and no new
 * buffer could be mapped. */
unsigned char *isw_bufpool_thread_buffer(struct isw_bufpool *p);
/* Unmap every buffer and free the pool.  Every thread that took a buffer must have exited
 * (its buffer is back in the pool). */
void isw_bufpool_destroy(struct isw_bufpool *p);

#endif
