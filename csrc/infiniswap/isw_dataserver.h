/*
 * isw_dataserver.h — the daemon's TCP data server: serves READ/WRITE of store regions to
 * devices on other hosts (wire format in isw_proto.h).  Two event-loop threads (epoll) serve
 * every connection, with pipelined requests answered in batches; a misbehaving client only
 * loses its own connection, and a client that does not read its replies holds up no other.
 */
#ifndef ISW_DATASERVER_H
#define ISW_DATASERVER_H

#include <stdint.h>

/* cffi:begin */
struct isw_store;
struct isw_server;

struct isw_server_stats {
    uint64_t connections;           /* accepted so far */
    uint64_t active_connections;
    uint64_t requests;
    uint64_t read_requests, write_requests;
    uint64_t bytes_read;            /* sent to clients */
    uint64_t bytes_written;         /* received into the store */
    uint64_t errors;                /* requests answered with an error */
};

/* Bind host:port (port 0: the OS picks) and start serving.  The store stays alive (and
 * cannot be closed) until the server is stopped. */
int isw_server_start(struct isw_store *store, const char *host, int port,
                     struct isw_server **out);
int isw_server_port(struct isw_server *srv);
/* Close the listener and every connection, join all threads, release the store.
 * Idempotent. */
int isw_server_stop(struct isw_server *srv);
/* Stop (if needed) and free. */
void isw_server_free(struct isw_server *srv);
int isw_server_get_stats(struct isw_server *srv, struct isw_server_stats *out);
/* cffi:end */

#endif
