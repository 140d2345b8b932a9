// RotaryEmbedding, bf16.
#include "../rope_entry.h"
ROPE_ENTRY(rope_ops_rotary_embedding_bf16, bfloat16_t, false)
