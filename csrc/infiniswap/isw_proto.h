/*
 * isw_proto.h — wire format of the daemon's TCP data server (the "one-sided" READ/WRITE
 * of remote slab memory when the device is on another host).
 *
 * Request (36 bytes, little endian):
 *   u32 magic (ISW_PROTO_MAGIC) | u16 version | u16 op (READ=1, WRITE=2)
 *   u64 region_offset | u32 length | u64 request_id | u64 generation
 *   followed by `length` payload bytes for WRITE.
 * Reply (16 bytes, little endian):
 *   u32 magic (ISW_PROTO_REPLY_MAGIC) | i32 status (0 or -errno) | u64 request_id
 *   followed by `length` payload bytes for a successful READ.
 *
 * A connection may carry any number of requests in flight (devices pipeline them); the
 * server answers a connection's requests in the order they came.
 *
 * A request must lie inside one allocated slab of the store and carry the generation of
 * the device's lease of that slab (isw_fence.h); a slab taken back since answers -ESTALE.
 * A bad magic, version, op or length gets an error reply and the connection is closed (the
 * stream cannot be trusted); a region or generation error gets an error reply and the
 * connection keeps serving.
 */
#ifndef ISW_PROTO_H
#define ISW_PROTO_H

#include <stdint.h>

/* cffi:begin */
#define ISW_PROTO_MAGIC 0x50575349u       /* "ISWP" */
#define ISW_PROTO_REPLY_MAGIC 0x52575349u /* "ISWR" */
#define ISW_PROTO_VERSION 2u        /* 2: requests carry the lease generation */
#define ISW_OP_READ 1u
#define ISW_OP_WRITE 2u
#define ISW_PROTO_REQ_SIZE 36
#define ISW_PROTO_REP_SIZE 16
#define ISW_PROTO_MAX_LEN (16u << 20)   /* largest length a server accepts */
#define ISW_PROTO_CHUNK (1u << 20)      /* largest length a client sends in one request */
/* cffi:end */

struct isw_req {
    uint32_t magic;
    uint16_t version;
    uint16_t op;
    uint64_t region_offset;
    uint32_t length;
    uint64_t req_id;
    uint64_t gen;
};

struct isw_rep {
    uint32_t magic;
    int32_t status;
    uint64_t req_id;
};

static inline void isw_put_le(unsigned char *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static inline uint64_t isw_get_le(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static inline void isw_req_encode(const struct isw_req *q, unsigned char out[ISW_PROTO_REQ_SIZE])
{
    isw_put_le(out + 0, q->magic, 4);
    isw_put_le(out + 4, q->version, 2);
    isw_put_le(out + 6, q->op, 2);
    isw_put_le(out + 8, q->region_offset, 8);
    isw_put_le(out + 16, q->length, 4);
    isw_put_le(out + 20, q->req_id, 8);
    isw_put_le(out + 28, q->gen, 8);
}

static inline void isw_req_decode(const unsigned char in[ISW_PROTO_REQ_SIZE], struct isw_req *q)
{
    q->magic = (uint32_t)isw_get_le(in + 0, 4);
    q->version = (uint16_t)isw_get_le(in + 4, 2);
    q->op = (uint16_t)isw_get_le(in + 6, 2);
    q->region_offset = isw_get_le(in + 8, 8);
    q->length = (uint32_t)isw_get_le(in + 16, 4);
    q->req_id = isw_get_le(in + 20, 8);
    q->gen = isw_get_le(in + 28, 8);
}

static inline void isw_rep_encode(const struct isw_rep *r, unsigned char out[ISW_PROTO_REP_SIZE])
{
    isw_put_le(out + 0, r->magic, 4);
    isw_put_le(out + 4, (uint32_t)r->status, 4);
    isw_put_le(out + 8, r->req_id, 8);
}

static inline void isw_rep_decode(const unsigned char in[ISW_PROTO_REP_SIZE], struct isw_rep *r)
{
    r->magic = (uint32_t)isw_get_le(in + 0, 4);
    r->status = (int32_t)(uint32_t)isw_get_le(in + 4, 4);
    r->req_id = isw_get_le(in + 8, 8);
}

#endif
