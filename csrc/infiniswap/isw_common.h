/*
 * isw_common.h — shared definitions of the Infiniswap C core.
 *
 * Owns: page/slab constants, the error convention, and small I/O and thread helpers.
 *
 * Error convention: every function that can fail returns 0 (or a non-negative value) on
 * success and a negative errno on failure.  Before returning an error the function stores
 * a human-readable message in a thread-local buffer (isw_last_error()), so the caller —
 * the same OS thread, right after the call — can report what went wrong.  Nothing in the
 * core aborts or exits on a user error.
 *
 * The part between the `cffi:begin` and `cffi:end` markers of this and the other public
 * headers is also the cffi declaration (cdef) of infiniswap._core: infiniswap/_build_core.py
 * reads it from here, so it stays plain C that cffi parses (no macros in declarations; a
 * `#define` there must be an integer constant, which Python sees as lib.<NAME>).
 */
#ifndef ISW_COMMON_H
#define ISW_COMMON_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

/* cffi:begin */
#define ISW_PAGE_SHIFT 12
#define ISW_PAGE_SIZE (1u << ISW_PAGE_SHIFT)
#define ISW_MIN_SLAB_SIZE ((uint64_t)1 << 20)

/* The message of the last error set by this thread ("" if none). */
const char *isw_last_error(void);
/* strerror for a negative (or positive) errno value; thread-safe. */
const char *isw_strerror(int rc);
/* cffi:end */

#if defined(__GNUC__)
#define ISW_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define ISW_PRINTF(a, b)
#endif

/* Store a message for this thread and return -err (err > 0; anything else becomes EIO). */
int isw_fail(int err, const char *fmt, ...) ISW_PRINTF(2, 3);
void isw_clear_error(void);

/* Whole-buffer pread/pwrite: 0 or -errno.  pread zero-fills past end of file. */
int isw_pread_full(int fd, void *buf, size_t len, uint64_t off);
int isw_pwrite_full(int fd, const void *buf, size_t len, uint64_t off);

void isw_sleep_us(unsigned us);
int isw_is_pow2(uint64_t v);
/* pthread_create with every signal blocked in the new thread (signals stay with Python). */
int isw_thread_start(pthread_t *th, void *(*fn)(void *), void *arg);

#endif
