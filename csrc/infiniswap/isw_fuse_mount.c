/*
 * isw_fuse_mount.c — detaching a FUSE mount and aborting its connection (see
 * isw_fuse_mount.h).
 *
 * Owns: the unmount (umount2 or a fusermount3 child process) and the fusectl abort,
 * including the private fusectl mount made for it when none is mounted.  Knows nothing of
 * the FUSE session or its threads: the caller (isw_fuse_stop) decides when to use them.
 */
#include "isw_fuse_mount.h"
#include "isw_common.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <sys/statfs.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

#define FUSECTL_DIR "/sys/fs/fuse/connections"
#define FUSECTL_MAGIC 0x65735543

int isw_fuse_detach_mount(const char *mnt)
{
    if (geteuid() == 0) {
        if (umount2(mnt, MNT_DETACH) == 0 || errno == EINVAL || errno == ENOENT)
            return 0;           /* EINVAL: not a mount point (any more) */
        return -errno;
    }
    char *argv[] = { "fusermount3", "-u", "-z", "-q", (char *)mnt, NULL };
    pid_t pid;
    int st, rc = posix_spawnp(&pid, "fusermount3", NULL, NULL, argv, environ);
    if (rc != 0)
        return -rc;
    while (waitpid(pid, &st, 0) < 0)
        if (errno != EINTR)
            return -errno;
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -EBUSY;
}

static int write_abort(const char *dir, uint64_t conn)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/%llu/abort", dir, (unsigned long long)conn);
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    ssize_t n = write(fd, "1", 1);
    int rc = n == 1 ? 0 : -errno;
    close(fd);
    return rc;
}

int isw_fuse_abort_connection(uint64_t conn_id)
{
    struct statfs sfs;
    int rc;

    if (statfs(FUSECTL_DIR, &sfs) == 0 && (unsigned long)sfs.f_type == FUSECTL_MAGIC) {
        rc = write_abort(FUSECTL_DIR, conn_id);
        if (rc == -ENOENT)
            return 0;           /* the connection is gone already */
        if (rc < 0)
            return isw_fail(-rc, "cannot abort FUSE connection %llu via " FUSECTL_DIR ": %s",
                            (unsigned long long)conn_id, isw_strerror(rc));
        return 0;
    }
    char dir[] = "/tmp/infiniswap-fusectl-XXXXXX";
    if (mkdtemp(dir) == NULL)
        return isw_fail(errno, "cannot abort FUSE connection %llu: fusectl is not mounted "
                        "and no directory could be made for it: %s",
                        (unsigned long long)conn_id, isw_strerror(errno));
    if (mount("fusectl", dir, "fusectl", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0) {
        rc = -errno;
        rmdir(dir);
        return isw_fail(-rc, "cannot abort FUSE connection %llu: fusectl is not mounted at "
                        FUSECTL_DIR " and mounting it failed: %s (needs root)",
                        (unsigned long long)conn_id, isw_strerror(rc));
    }
    rc = write_abort(dir, conn_id);
    umount2(dir, MNT_DETACH);
    rmdir(dir);
    if (rc == -ENOENT)
        return 0;
    if (rc < 0)
        return isw_fail(-rc, "cannot abort FUSE connection %llu: %s",
                        (unsigned long long)conn_id, isw_strerror(rc));
    return 0;
}
