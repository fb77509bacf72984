/*
 * isw_auth.c — the cluster-key handshake of the TCP data path (see isw_auth.h): proofs
 * (HMAC-SHA256, OpenSSL libcrypto), nonces (RAND_bytes), the server's check of an answer
 * and the client's whole handshake.  No home-made crypto: HMAC, the random numbers and the
 * constant-time compare (CRYPTO_memcmp) are OpenSSL's.
 *
 * Owns: nothing; the caller owns the key, the socket and the buffers.  The key is never
 * written to a message, a log line or an error text.
 */
#include "isw_auth.h"
#include "isw_common.h"
#include "isw_net.h"
#include "isw_proto.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/uio.h>

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <openssl/rand.h>

int isw_auth_check_key(const unsigned char *key, size_t key_len)
{
    if (key == NULL || key_len < ISW_AUTH_KEY_MIN || key_len > ISW_AUTH_KEY_MAX)
        return isw_fail(EINVAL, "the cluster key must be %d..%d bytes, got %zu",
                        ISW_AUTH_KEY_MIN, ISW_AUTH_KEY_MAX, key == NULL ? (size_t)0 : key_len);
    return 0;
}

int isw_auth_nonce(unsigned char nonce[ISW_AUTH_NONCE_SIZE])
{
    if (RAND_bytes(nonce, ISW_AUTH_NONCE_SIZE) != 1)
        return isw_fail(EIO, "OpenSSL's RAND_bytes could not make a nonce");
    return 0;
}

int isw_auth_proof(const unsigned char *key, size_t key_len, const unsigned char *nonce,
                   size_t nonce_len, const char *role, const unsigned char *context,
                   size_t context_len, unsigned char *out)
{
    static const unsigned char sep = 0;
    char digest[] = "SHA256";
    OSSL_PARAM params[] = {
        OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
        OSSL_PARAM_construct_end(),
    };
    size_t out_len = 0;
    int ok;

    if (isw_auth_check_key(key, key_len) < 0)
        return -EINVAL;
    if (nonce == NULL || nonce_len == 0 || role == NULL || out == NULL)
        return isw_fail(EINVAL, "a proof needs a nonce, a role and an output buffer");
    EVP_MAC *mac = EVP_MAC_fetch(NULL, "HMAC", NULL);
    EVP_MAC_CTX *ctx = mac != NULL ? EVP_MAC_CTX_new(mac) : NULL;
    ok = ctx != NULL &&
         EVP_MAC_init(ctx, key, key_len, params) == 1 &&
         EVP_MAC_update(ctx, (const unsigned char *)role, strlen(role)) == 1 &&
         EVP_MAC_update(ctx, &sep, 1) == 1 &&
         EVP_MAC_update(ctx, nonce, nonce_len) == 1;
    if (ok && context != NULL)
        ok = EVP_MAC_update(ctx, &sep, 1) == 1 && EVP_MAC_update(ctx, context, context_len) == 1;
    ok = ok && EVP_MAC_final(ctx, out, &out_len, ISW_AUTH_PROOF_SIZE) == 1 &&
         out_len == ISW_AUTH_PROOF_SIZE;
    EVP_MAC_CTX_free(ctx);
    EVP_MAC_free(mac);
    return ok ? 0 : isw_fail(EIO, "OpenSSL's HMAC-SHA256 failed");
}

void isw_auth_hello(const unsigned char nonce_s[ISW_AUTH_NONCE_SIZE], unsigned char *out)
{
    isw_put_le(out, ISW_AUTH_HELLO_MAGIC, 4);
    isw_put_le(out + 4, ISW_AUTH_VERSION, 2);
    isw_put_le(out + 6, 0, 2);
    memcpy(out + 8, nonce_s, ISW_AUTH_NONCE_SIZE);
}

static void put_verdict(unsigned char *out, int status, const unsigned char *proof)
{
    isw_put_le(out, ISW_AUTH_VERDICT_MAGIC, 4);
    isw_put_le(out + 4, (uint32_t)status, 4);
    if (proof != NULL)
        memcpy(out + 8, proof, ISW_AUTH_PROOF_SIZE);
    else
        memset(out + 8, 0, ISW_AUTH_PROOF_SIZE);
}

int isw_auth_server_check(const unsigned char *key, size_t key_len,
                          const unsigned char nonce_s[ISW_AUTH_NONCE_SIZE],
                          const unsigned char *answer, unsigned char *verdict, char *why,
                          size_t why_len)
{
    unsigned char expect[ISW_AUTH_PROOF_SIZE], mine[ISW_AUTH_PROOF_SIZE];
    const unsigned char *nonce_c = answer + 8 + ISW_AUTH_PROOF_SIZE;
    int rc = 0;

    if (isw_get_le(answer, 4) != ISW_AUTH_ANSWER_MAGIC || isw_get_le(answer + 4, 2) != ISW_AUTH_VERSION) {
        snprintf(why, why_len, "not a handshake answer of version %d (magic %08llx)",
                 ISW_AUTH_VERSION, (unsigned long long)isw_get_le(answer, 4));
        rc = -EPROTO;
    } else if (isw_auth_proof(key, key_len, nonce_s, ISW_AUTH_NONCE_SIZE, ISW_AUTH_ROLE_DEVICE,
                              NULL, 0, expect) < 0) {
        snprintf(why, why_len, "cannot compute the expected proof: %s", isw_last_error());
        rc = -EIO;
    } else if (CRYPTO_memcmp(expect, answer + 8, ISW_AUTH_PROOF_SIZE) != 0) {
        snprintf(why, why_len, "wrong proof of the cluster key (another key, or a replayed "
                 "answer to an old nonce)");
        rc = -EACCES;
    } else if (isw_auth_proof(key, key_len, nonce_c, ISW_AUTH_NONCE_SIZE, ISW_AUTH_ROLE_DAEMON,
                              nonce_s, ISW_AUTH_NONCE_SIZE, mine) < 0) {
        snprintf(why, why_len, "cannot compute this server's proof: %s", isw_last_error());
        rc = -EIO;
    }
    put_verdict(verdict, rc, rc == 0 ? mine : NULL);
    OPENSSL_cleanse(expect, sizeof expect);
    return rc;
}

int isw_auth_client(int fd, const unsigned char *key, size_t key_len)
{
    unsigned char hello[ISW_AUTH_HELLO_SIZE], answer[ISW_AUTH_ANSWER_SIZE];
    unsigned char verdict[ISW_AUTH_VERDICT_SIZE], expect[ISW_AUTH_PROOF_SIZE];
    unsigned char *nonce_c = answer + 8 + ISW_AUTH_PROOF_SIZE;
    int rc = isw_auth_check_key(key, key_len);

    if (rc < 0)
        return rc;
    rc = isw_recv_all(fd, hello, sizeof hello);
    if (rc < 0)
        return isw_fail(-rc, "no handshake from the data server: %s", isw_strerror(rc));
    if (isw_get_le(hello, 4) != ISW_AUTH_HELLO_MAGIC || isw_get_le(hello + 4, 2) != ISW_AUTH_VERSION)
        return isw_fail(EPROTO, "the data server does not speak the handshake of version %d "
                        "(an older daemon, or not a daemon)", ISW_AUTH_VERSION);
    isw_put_le(answer, ISW_AUTH_ANSWER_MAGIC, 4);
    isw_put_le(answer + 4, ISW_AUTH_VERSION, 2);
    isw_put_le(answer + 6, 0, 2);
    rc = isw_auth_nonce(nonce_c);
    if (rc == 0)
        rc = isw_auth_proof(key, key_len, hello + 8, ISW_AUTH_NONCE_SIZE, ISW_AUTH_ROLE_DEVICE,
                            NULL, 0, answer + 8);
    if (rc < 0)
        return rc;
    struct iovec iov = { answer, sizeof answer };
    rc = isw_send_all(fd, &iov, 1);
    if (rc == 0)
        rc = isw_recv_all(fd, verdict, sizeof verdict);
    if (rc < 0)
        return isw_fail(-rc, "handshake with the data server failed: %s", isw_strerror(rc));
    if (isw_get_le(verdict, 4) != ISW_AUTH_VERDICT_MAGIC)
        return isw_fail(EPROTO, "the data server answered the handshake with garbage");
    int status = (int32_t)(uint32_t)isw_get_le(verdict + 4, 4);
    if (status != 0)
        return isw_fail(EACCES, "the data server refused this device's proof of the cluster key "
                        "(%s): the two hosts do not hold the same cluster key",
                        isw_strerror(status));
    rc = isw_auth_proof(key, key_len, nonce_c, ISW_AUTH_NONCE_SIZE, ISW_AUTH_ROLE_DAEMON,
                        hello + 8, ISW_AUTH_NONCE_SIZE, expect);
    if (rc < 0)
        return rc;
    if (CRYPTO_memcmp(expect, verdict + 8, ISW_AUTH_PROOF_SIZE) != 0)
        return isw_fail(EACCES, "the data server could not prove the cluster key: refusing it "
                        "(not this cluster's daemon)");
    return 0;
}
