/* Byte ranges copied in one call: the scatter of a gather's pieces into the shared-memory
 * segment ([Note: the block layout of a gather] in deepspeed/comm/shm.py).
 *
 * Plain C with no torch header, so it compiles in a fraction of a second on first use and
 * is loaded with ctypes (deepspeed/ops/op_builder/shm_copy.py). torch would spend about a
 * microsecond of dispatch on each piece: 200 pieces of a 100-parameter module cost more
 * than the copying itself.
 */
#include <stdint.h>
#include <string.h>

/* Piece i: len[i] bytes from src + src_off[i] to dst + dst_off[i]; pieces must not overlap. */
void ds_copy_pieces(int64_t n, char *dst, const int64_t *dst_off, const char *src, const int64_t *src_off,
                    const int64_t *len) {
    for (int64_t i = 0; i < n; ++i) {
        memcpy(dst + dst_off[i], src + src_off[i], (size_t)len[i]);
    }
}
