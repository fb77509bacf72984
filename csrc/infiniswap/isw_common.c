/*
 * isw_common.c — thread-local error messages and small I/O / thread helpers
 * (see isw_common.h for the error convention).
 *
 * Owns: the thread-local message buffers (last error, strerror); everything else here is
 * stateless.
 */
#include "isw_common.h"

#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static _Thread_local char tl_err[512];
static _Thread_local char tl_strerr[128];

int isw_fail(int err, const char *fmt, ...)
{
    char tmp[sizeof tl_err];
    va_list ap;

    /* Format into a temporary first: callers may pass isw_last_error() as an argument. */
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    memcpy(tl_err, tmp, sizeof tl_err);
    if (err <= 0)
        err = EIO;
    return -err;
}

const char *isw_last_error(void)
{
    return tl_err;
}

void isw_clear_error(void)
{
    tl_err[0] = '\0';
}

const char *isw_strerror(int rc)
{
    int e = rc < 0 ? -rc : rc;
    return strerror_r(e, tl_strerr, sizeof tl_strerr);
}

int isw_pread_full(int fd, void *buf, size_t len, uint64_t off)
{
    unsigned char *p = buf;

    while (len > 0) {
        ssize_t n = pread(fd, p, len, (off_t)off);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (n == 0) {           /* past end of file: a never-written region reads as zeros */
            memset(p, 0, len);
            return 0;
        }
        p += n;
        len -= (size_t)n;
        off += (uint64_t)n;
    }
    return 0;
}

int isw_pwrite_full(int fd, const void *buf, size_t len, uint64_t off)
{
    const unsigned char *p = buf;

    while (len > 0) {
        ssize_t n = pwrite(fd, p, len, (off_t)off);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (n == 0)
            return -EIO;
        p += n;
        len -= (size_t)n;
        off += (uint64_t)n;
    }
    return 0;
}

void isw_sleep_us(unsigned us)
{
    struct timespec ts = { .tv_sec = us / 1000000u, .tv_nsec = (long)(us % 1000000u) * 1000L };
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

int isw_is_pow2(uint64_t v)
{
    return v != 0 && (v & (v - 1)) == 0;
}

int isw_thread_start(pthread_t *th, void *(*fn)(void *), void *arg)
{
    sigset_t all, old;
    int rc;

    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    rc = pthread_create(th, NULL, fn, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return -rc;
}
