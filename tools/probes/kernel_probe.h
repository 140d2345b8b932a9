// The C interface tools/kernel_probe.py expects of a probe source (bf16 data, float32 tables,
// int64 positions, contiguous [tokens, H, D] q and k).
#pragma once
#include <stdint.h>

typedef struct ProbeCall {
  const void* q;
  const void* k;
  void* q_out;  // ignored when inplace
  void* k_out;
  const void* pos;  // int64 [tokens]
  const float* cos_t;
  const float* sin_t;
  const int64_t* freq_turns;
  int64_t tokens, table_rows;
  int Hq, Hk, D, R, interleaved, inverse, inplace, pdl;
} ProbeCall;

#ifdef __cplusplus
extern "C" {
#endif
int probe_count(void);
const char* probe_name(int which);
// 0: launched; 1: this probe does not apply to the call; anything else: an error.
int probe_launch(int which, const ProbeCall* call, void* stream);
#ifdef __cplusplus
}
#endif
