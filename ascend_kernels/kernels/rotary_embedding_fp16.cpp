// RotaryEmbedding, fp16.
#include "../rope_entry.h"
ROPE_ENTRY(rope_ops_rotary_embedding_fp16, half, false)
