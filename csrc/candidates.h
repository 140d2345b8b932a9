// The configurations that can take a call, as readable labels, for the benchmark tooling (not
// API): timing every candidate of a matrix of shapes in one run is how policy.h's thresholds are
// fitted. Labels:
//   heads/<schedule>/u<heads per thread>/t<threads per block>   schedule pipe2 or rounds4;
//   heads/u1/t<threads>                                         one head per thread
//   flat/separate, flat/joint, flat/split/v<vectors per thread>
//   lean, rows, generic
// with "+fly" (every cos/sin row from freq_turns) and "+nopdl" (no programmatic dependent
// launch) appended where they apply.
#pragma once

#include <stdio.h>
#include <string.h>

#include "policy.h"

namespace rope_ops_cuda {
namespace {

// Whether configuration c can take the call (the family's own conditions on top of 16-byte
// vectors); what rope_launch_config accepts.
inline bool config_fits(const RopeParams& p, const RopeDevice& dev, const RopeConfig& c) {
  if (!params_ok(p)) return false;
  const CallFacts f = facts_of(p, dev);
  if (f.nothing) return c.family == ROPE_NOTHING;
  if (c.pdl != 0 && (c.pdl != 1 || !dev.pdl)) return false;
  if (c.rows_on_the_fly != 0 && (c.rows_on_the_fly != 1 || p.freq_turns == nullptr)) return false;
  if (!every_family(p) && !(c.family == ROPE_GENERIC || (c.family == ROPE_HEADS && c.vector_bytes == 16)))
    return false;
  switch (c.family) {
    case ROPE_GENERIC:
      return c.rows_on_the_fly == 0;
    case ROPE_HEADS: {
      if (!(c.vector_bytes == 16 ? f.vectors : c.vector_bytes == 8 && f.vectors8)) return false;
      if (c.heads_per_thread < 1 || c.heads_per_thread > 16) return false;
      if (c.schedule != ROPE_PIPE2_STREAM && c.schedule != ROPE_ROUNDS4_PLAIN) return false;
      const int64_t V = c.vector_bytes / elem_bytes(p);
      return heads_fits(plan_heads(p, V, f.neox, c.heads_per_thread, c.block_threads));
    }
    case ROPE_FLAT:
      return f.vectors && flat_ok(p, f.V) && flat_blocks_fit(p, f.V, c.flat_blocks, c.vectors);
    case ROPE_LEAN:
      return f.vectors && c.rows_on_the_fly == 0 && flat_ok(p, f.V) && lean_fits(p, f.V);
    case ROPE_ROWS:
      return f.vectors && rows_fits(p, f.V);
    default:
      return false;
  }
}

inline int config_label(const RopeConfig& c, char* buf, const int size) {
  char base[64];
  switch (c.family) {
    case ROPE_HEADS: {
      const char* family = c.vector_bytes == 8 ? "heads8" : "heads";
      if (c.heads_per_thread == 1)
        snprintf(base, sizeof base, "%s/u1/t%d", family, c.block_threads);
      else
        snprintf(base, sizeof base, "%s/%s/u%d/t%d", family,
                 c.schedule == ROPE_ROUNDS4_PLAIN ? "rounds4" : "pipe2", c.heads_per_thread,
                 c.block_threads);
      break;
    }
    case ROPE_FLAT:
      if (c.flat_blocks == ROPE_FLAT_SPLIT)
        snprintf(base, sizeof base, "flat/split/v%d", c.vectors);
      else
        snprintf(base, sizeof base, "flat/%s", c.flat_blocks == ROPE_FLAT_JOINT ? "joint" : "separate");
      break;
    case ROPE_LEAN: snprintf(base, sizeof base, "lean"); break;
    case ROPE_ROWS: snprintf(base, sizeof base, "rows"); break;
    case ROPE_GENERIC: snprintf(base, sizeof base, "generic"); break;
    default: snprintf(base, sizeof base, "nothing"); break;
  }
  return snprintf(buf, size, "%s%s%s", base, c.rows_on_the_fly ? "+fly" : "", c.pdl ? "" : "+nopdl");
}

// The configuration a label names (pdl on unless "+nopdl"). false for anything else.
inline bool parse_label(const char* label, RopeConfig& c) {
  c = RopeConfig{};
  c.pdl = 1;
  char text[64];
  if (strlen(label) >= sizeof text) return false;
  strcpy(text, label);
  if (char* suffix = strchr(text, '+')) {
    *suffix = '\0';
    while (suffix != nullptr) {
      char* next = strchr(suffix + 1, '+');
      if (next != nullptr) *next = '\0';
      if (strcmp(suffix + 1, "fly") == 0) c.rows_on_the_fly = 1;
      else if (strcmp(suffix + 1, "nopdl") == 0) c.pdl = 0;
      else return false;
      suffix = next;
    }
  }
  int a = 0, b = 0, n = 0;
  char family[16], sched[16];
  const size_t len = strlen(text);
  c.vector_bytes = 16;
  if (sscanf(text, "%15[a-z0-9]/u1/t%d%n", family, &a, &n) == 2 && (size_t)n == len) {
    c.family = ROPE_HEADS;
    c.heads_per_thread = 1;
    c.block_threads = a;
  } else if (sscanf(text, "%15[a-z0-9]/%15[a-z0-9]/u%d/t%d%n", family, sched, &a, &b, &n) == 4 &&
             (size_t)n == len) {
    c.family = ROPE_HEADS;
    if (strcmp(sched, "pipe2") == 0) c.schedule = ROPE_PIPE2_STREAM;
    else if (strcmp(sched, "rounds4") == 0) c.schedule = ROPE_ROUNDS4_PLAIN;
    else return false;
    c.heads_per_thread = a;
    c.block_threads = b;
    if (a < 2) return false;
  }
  if (c.family == ROPE_HEADS) {
    if (strcmp(family, "heads8") == 0) c.vector_bytes = 8;
    return strcmp(family, "heads") == 0 || c.vector_bytes == 8;
  }
  if (sscanf(text, "flat/split/v%d%n", &a, &n) == 1 && (size_t)n == len) {
    c.family = ROPE_FLAT;
    c.flat_blocks = ROPE_FLAT_SPLIT;
    c.vectors = a;
    return true;
  }
  const struct { const char* name; int family, blocks; } plain[] = {
      {"flat/separate", ROPE_FLAT, ROPE_FLAT_SEPARATE}, {"flat/joint", ROPE_FLAT, ROPE_FLAT_JOINT},
      {"lean", ROPE_LEAN, 0}, {"rows", ROPE_ROWS, 0}, {"generic", ROPE_GENERIC, 0},
      {"nothing", ROPE_NOTHING, 0}};
  for (const auto& e : plain) {
    if (strcmp(text, e.name) == 0) {
      c.family = e.family;
      c.flat_blocks = e.blocks;
      return true;
    }
  }
  return false;
}

inline bool same_config(const RopeConfig& a, const RopeConfig& b) {
  char la[64], lb[64];
  config_label(a, la, sizeof la);
  config_label(b, lb, sizeof lb);
  return strcmp(la, lb) == 0;
}

// Every configuration that can take the call, the policy's choice first, each launch once.
template <class Out>
void list_candidates(const RopeParams& p, const RopeDevice& dev, Out&& add) {
  const RopeConfig chosen = choose(p, dev);
  int listed = 0;
  RopeConfig seen[96];
  const auto offer = [&](const RopeConfig& c) {
    if (!config_fits(p, dev, c)) return;
    for (int i = 0; i < listed; ++i)
      if (same_config(seen[i], c)) return;
    if (listed < 96) seen[listed++] = c;
    add(c);
  };
  offer(chosen);
  const CallFacts f = facts_of(p, dev);
  if (f.nothing) return;
  RopeConfig c = config_of(ROPE_GENERIC, dev);
  // the heads family with 16-byte vectors, or with 8-byte ones where only those fit
  for (const int most : {1, 2, 3, 4, 6, 8}) {
    const int u = canonical_heads(most, f.heads);
    for (const int threads : {128, 256}) {
      for (const int schedule : {ROPE_PIPE2_STREAM, ROPE_ROUNDS4_PLAIN}) {
        c = config_of(ROPE_HEADS, dev);
        c.vector_bytes = f.vectors ? 16 : 8;
        c.heads_per_thread = u;
        c.block_threads = threads;
        c.schedule = u == 1 ? 0 : schedule;
        offer(c);
      }
    }
  }
  if (!f.vectors) {
    offer(config_of(ROPE_GENERIC, dev));
  } else {
    for (const int blocks : {ROPE_FLAT_SEPARATE, ROPE_FLAT_JOINT}) {
      c = config_of(ROPE_FLAT, dev);
      c.flat_blocks = blocks;
      offer(c);
    }
    if (f.decode) {
      for (const int v : {1, 2, 4}) {
        c = config_of(ROPE_FLAT, dev);
        c.flat_blocks = ROPE_FLAT_SPLIT;
        c.vectors = v;
        offer(c);
      }
    }
    offer(config_of(ROPE_LEAN, dev));
    offer(config_of(ROPE_ROWS, dev));
  }
  // Rows on the fly for the choice and the flat (whole-token blocks) and rows kernels.
  if (p.freq_turns != nullptr) {
    for (int i = 0, n = listed; i < n; ++i) {
      const RopeConfig& s = seen[i];
      if (i == 0 || s.family == ROPE_ROWS || (s.family == ROPE_FLAT && s.flat_blocks != ROPE_FLAT_SPLIT)) {
        c = s;
        c.rows_on_the_fly = 1;
        offer(c);
      }
    }
  }
  if (chosen.pdl) {
    c = chosen;
    c.pdl = 0;
    offer(c);
  }
}

}  // namespace
}  // namespace rope_ops_cuda
