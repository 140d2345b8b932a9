// RotaryEmbeddingGrad (rotation by minus the angle), fp16.
#include "../rope_entry.h"
ROPE_ENTRY(rope_ops_rotary_embedding_grad_fp16, half, true)
