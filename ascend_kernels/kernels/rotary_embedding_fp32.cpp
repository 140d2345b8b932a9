// RotaryEmbedding, fp32.
#include "../rope_entry.h"
ROPE_ENTRY(rope_ops_rotary_embedding_fp32, float, false)
