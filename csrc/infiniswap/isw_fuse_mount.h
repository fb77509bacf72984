/*
 * isw_fuse_mount.h — taking a FUSE mount down from the outside: detach the mount point,
 * and abort the kernel's FUSE connection through fusectl when requests are stuck.  Used by
 * isw_fuse_stop(); nothing here touches the FUSE session.
 */
#ifndef ISW_FUSE_MOUNT_H
#define ISW_FUSE_MOUNT_H

#include <stdint.h>

/* Detach the mount lazily (umount2 MNT_DETACH as root, `fusermount3 -u -z` else), so it
 * works while the file is busy.  0 (also when nothing is mounted there), or -errno
 * (-EBUSY when fusermount3 failed); sets no error message. */
int isw_fuse_detach_mount(const char *mountpoint);
/* Abort FUSE connection conn_id: every queued and future request fails and every worker's
 * read of /dev/fuse returns ENODEV.  Uses /sys/fs/fuse/connections, or mounts fusectl on a
 * private directory for the moment if it is not mounted there (needs root).  0 (also when
 * the connection is gone already), or -errno with a message in isw_last_error(). */
int isw_fuse_abort_connection(uint64_t conn_id);

#endif
