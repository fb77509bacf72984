/*
 * isw_auth.h — the cluster-key handshake of the TCP data path (docs/infiniswap.md,
 * "Security").  Every connection to a daemon's data server proves, both ways, that its two
 * ends hold the cluster key (dlrt/keys.py) before a single slab byte moves.  The key never
 * travels: each side answers the other's fresh nonce with HMAC-SHA256 (OpenSSL libcrypto),
 * the same function as dlrt/proof.py's proof(secret, nonce, role, *context).
 *
 * Handshake (server speaks first; little endian):
 *   server -> client  HELLO   (24 bytes): u32 ISW_AUTH_HELLO_MAGIC | u16 version | u16 0
 *                                         | nonce_s[16]
 *   client -> server  ANSWER  (56 bytes): u32 ISW_AUTH_ANSWER_MAGIC | u16 version | u16 0
 *                                         | proof_c[32] | nonce_c[16]
 *                     proof_c = proof(key, nonce_s, "isw-device")
 *   server -> client  VERDICT (40 bytes): u32 ISW_AUTH_VERDICT_MAGIC | i32 status
 *                                         | proof_s[32]
 *                     status 0: proof_s = proof(key, nonce_c, "isw-daemon", nonce_s);
 *                     status -EACCES (wrong proof) or -EPROTO (garbled answer): proof_s is
 *                     zero and the server closes the connection.
 * The client refuses a server whose proof_s is wrong (it does not hold the key).  A nonce
 * is used for one connection only, so a recorded answer is worth nothing on another one
 * (replay); the role strings keep one side's answer from serving as the other's.
 */
#ifndef ISW_AUTH_H
#define ISW_AUTH_H

#include <stddef.h>
#include <stdint.h>

/* cffi:begin */
#define ISW_AUTH_VERSION 1
#define ISW_AUTH_HELLO_MAGIC 0x48575349u    /* "ISWH" */
#define ISW_AUTH_ANSWER_MAGIC 0x41575349u   /* "ISWA" */
#define ISW_AUTH_VERDICT_MAGIC 0x56575349u  /* "ISWV" */
#define ISW_AUTH_NONCE_SIZE 16
#define ISW_AUTH_PROOF_SIZE 32
#define ISW_AUTH_HELLO_SIZE 24
#define ISW_AUTH_ANSWER_SIZE 56
#define ISW_AUTH_VERDICT_SIZE 40
#define ISW_AUTH_KEY_MIN 16
#define ISW_AUTH_KEY_MAX 64
#define ISW_AUTH_TIMEOUT_MS 2000            /* a server's default handshake deadline */

/* HMAC-SHA256(key, role || 0x00 || nonce [|| 0x00 || context]) into out[32] (context:
 * NULL for none) — dlrt.proof.proof(key, nonce, role[, context]).  0 or -errno. */
int isw_auth_proof(const unsigned char *key, size_t key_len, const unsigned char *nonce,
                   size_t nonce_len, const char *role, const unsigned char *context,
                   size_t context_len, unsigned char *out);
/* cffi:end */

#define ISW_AUTH_ROLE_DEVICE "isw-device"
#define ISW_AUTH_ROLE_DAEMON "isw-daemon"

/* 0, or -EINVAL (recorded) when a key of key_len bytes cannot be a cluster key. */
int isw_auth_check_key(const unsigned char *key, size_t key_len);
/* A fresh nonce from OpenSSL's CSPRNG: 0 or -EIO (recorded). */
int isw_auth_nonce(unsigned char nonce[ISW_AUTH_NONCE_SIZE]);

/* ---- the server's side (isw_dataserver.c drives it from its event loop) ---- */

/* HELLO carrying nonce_s into out[ISW_AUTH_HELLO_SIZE]. */
void isw_auth_hello(const unsigned char nonce_s[ISW_AUTH_NONCE_SIZE], unsigned char *out);
/* Check a client's ANSWER to nonce_s and write the VERDICT to send into
 * verdict[ISW_AUTH_VERDICT_SIZE].  0 (accepted), -EPROTO (not an answer of this version) or
 * -EACCES (the proof is wrong: the client does not hold the key); `why` gets a message
 * (never the key) when it refuses. */
int isw_auth_server_check(const unsigned char *key, size_t key_len,
                          const unsigned char nonce_s[ISW_AUTH_NONCE_SIZE],
                          const unsigned char *answer, unsigned char *verdict, char *why,
                          size_t why_len);

/* ---- the client's side ---- */

/* The whole handshake on a connected blocking socket whose send/receive timeouts are set
 * (isw_tcp_connect): 0, or -errno with a message recorded (isw_last_error): -EACCES when
 * the server refused our proof or could not prove the key itself, -EPROTO when it does not
 * speak this handshake, -ETIMEDOUT / -ECONNRESET from the socket. */
int isw_auth_client(int fd, const unsigned char *key, size_t key_len);

#endif
