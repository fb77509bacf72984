/*
 * isw_remote.c — the parts of a remote shared by every backend: description, dead flag and
 * the last error message.
 *
 * Owns: the fields of struct isw_remote (isw_remote.h); each backend owns its transport.
 */
#include "isw_remote.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

void isw_remote_init(struct isw_remote *r, const struct isw_remote_ops *ops, uint64_t size,
                     uint64_t slab_size, const char *desc)
{
    r->ops = ops;
    r->id = -1;
    r->nslabs = 0;
    r->size = size;
    r->slab_size = slab_size;
    r->rto_min_us = 0;
    atomic_init(&r->dead, 0);
    atomic_init(&r->errors, 0);
    atomic_init(&r->bytes_read, 0);
    atomic_init(&r->bytes_written, 0);
    pthread_mutex_init(&r->err_mu, NULL);
    r->err[0] = '\0';
    snprintf(r->desc, sizeof r->desc, "%s", desc);
}

void isw_remote_fini(struct isw_remote *r)
{
    pthread_mutex_destroy(&r->err_mu);
}

int isw_remote_error(struct isw_remote *r, int mark_dead, int err, const char *fmt, ...)
{
    char msg[256];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    atomic_fetch_add(&r->errors, 1);
    if (mark_dead)
        atomic_store(&r->dead, 1);
    pthread_mutex_lock(&r->err_mu);
    snprintf(r->err, sizeof r->err, "%s", msg);
    pthread_mutex_unlock(&r->err_mu);
    return isw_fail(err, "remote %s: %s", r->desc, msg);
}

void isw_remote_last_error(struct isw_remote *r, char *out, size_t n)
{
    pthread_mutex_lock(&r->err_mu);
    snprintf(out, n, "%s", r->err);
    pthread_mutex_unlock(&r->err_mu);
}
