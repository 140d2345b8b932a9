// RotaryEmbeddingGrad (rotation by minus the angle), fp32.
#include "../rope_entry.h"
ROPE_ENTRY(rope_ops_rotary_embedding_grad_fp32, float, true)
