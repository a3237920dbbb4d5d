// The Adam step written once over a vector type, instantiated by each instruction-set file.
//
// Include this inside an anonymous namespace, after defining
//   DS_TARGET  a function attribute selecting the instruction set (may be empty), and
//   struct V   W lanes of float (V::F) with: ld/st overloads for float, Bf16, Half (and st
//              for NoOut, a no-op), set1, add, sub, mul, div, sqrt, fmadd(a, b, c) = a*b+c
//              rounded once, and for the bandwidth floor stream (a non-temporal store, or a
//              plain one where the ISA has none) and fence (orders those stores, or nothing).
// The element tags Bf16, Half and NoOut come from adam_span.h.
// Everything here has internal linkage, so nothing compiled for a wider instruction set can
// stand in for a baseline function elsewhere in the library.
//
// [Note: matching torch rounding]
// Each element goes through the float operations of torch.optim.Adam / AdamW's
// single-tensor path, in the same order, with fused multiply-adds exactly where torch's
// vectorized CPU kernels fuse (the build passes -ffp-contract=off so the compiler fuses
// nothing else):
//   AdamW: p = p * (1 - lr * wd)                     Adam: g = fmadd(p, wd, g)
//   m = fmadd(c, g - m, base)   torch's lerp: c = w, base = m for w < 0.5, else c = w - 1, base = g
//   v = fmadd((1 - beta2) * g, g, v * beta2)         torch's mul_ then addcmul_
//   p = p + (-step_size * m) / (sqrt(v) * (1 / sqrt(bias_correction2)) + eps)
// One departure: torch divides sqrt(v) by sqrt(bias_correction2); the kernel multiplies by
// the reciprocal (rounded once from double), because the divider is the bottleneck when the
// tensors sit in cache, and a second division per element made cache-resident steps ~25%
// slower. That and torch's sqrt (which may differ from the correctly rounded one by an ulp)
// move denom by an ulp or so, so parameters agree with torch to a few float ulps (tests: rtol
// 1e-6, atol 1e-6 after 20 steps), not bitwise. Low-precision
// parameters and copies are rounded from fp32 to nearest even, as tensor.to(dtype) does.

template <class T>
struct TypeOf;
template <>
struct TypeOf<float> {
  static constexpr ds_adam::Dtype value = ds_adam::Dtype::kF32;
};
template <>
struct TypeOf<Bf16> {
  static constexpr ds_adam::Dtype value = ds_adam::Dtype::kBF16;
};
template <>
struct TypeOf<Half> {
  static constexpr ds_adam::Dtype value = ds_adam::Dtype::kF16;
};
template <>
struct TypeOf<NoOut> {
  static constexpr ds_adam::Dtype value = ds_adam::Dtype::kNone;
};

// `ptr + i`, except for the absent copy-out, whose pointer is null and never dereferenced.
template <class T>
inline T* offset(T* ptr, int64_t i) {
  return ptr + i;
}
inline NoOut* offset(NoOut* ptr, int64_t) { return ptr; }

// The step's constants, broadcast once per span.
struct Consts {
  V::F lerp_coeff, beta2, one_minus_beta2, inv_bc2_sqrt, eps, neg_step, weight_decay, decay_factor;
};

DS_TARGET inline Consts broadcast(const ds_adam::Scalars& s) {
  return Consts{V::set1(s.lerp_coeff), V::set1(s.beta2),        V::set1(s.one_minus_beta2),
                V::set1(s.inv_bias_correction2_sqrt), V::set1(s.eps), V::set1(s.neg_step_size),
                V::set1(s.weight_decay),          V::set1(s.decay_factor)};
}

// One vector of W elements at p, g, m, v (and o). `decay` and `from_avg` are constant for the
// whole span: the branches on them are predicted and cost nothing next to the memory traffic.
// Every load comes before every store, as in the floor below.
template <class PT, class GT, class OT>
DS_TARGET inline void adam_vector(PT* p, const GT* g, float* m, float* v, OT* o, const Consts& c,
                                  ds_adam::Decay decay, bool from_avg) {
  typename V::F param = V::ld(p);
  typename V::F grad = V::ld(g);
  const typename V::F avg = V::ld(m);
  const typename V::F sq = V::ld(v);
  if (decay == ds_adam::Decay::kL2) {
    grad = V::fmadd(param, c.weight_decay, grad);
  } else if (decay == ds_adam::Decay::kDecoupled) {
    param = V::mul(param, c.decay_factor);
  }
  const typename V::F diff = V::sub(grad, avg);
  const typename V::F new_avg = V::fmadd(c.lerp_coeff, diff, from_avg ? avg : grad);
  const typename V::F new_sq = V::fmadd(V::mul(c.one_minus_beta2, grad), grad, V::mul(sq, c.beta2));
  const typename V::F denom = V::add(V::mul(V::sqrt(new_sq), c.inv_bc2_sqrt), c.eps);
  param = V::add(param, V::div(V::mul(c.neg_step, new_avg), denom));
  V::st(m, new_avg);
  V::st(v, new_sq);
  V::st(p, param);
  V::st(o, param);
}

// [Note: software prefetch where the CPU needs it]
// A step does ~15 vector operations per element, a sqrt and a division among them, so the
// out-of-order window reaches fewer cache lines ahead than a plain streaming loop does, and
// the step leans on the hardware prefetchers. How far those carry differs by vendor; both
// measured with 8M fp32 params, a standalone copy of this loop, 4 KiB pages:
//   - Zen 4: a prefetch 1024 elements ahead on each of the four streams made the step
//     10-12% slower at 1 and 2 threads (256 and 4096 ahead were no better).
//   - Intel (Sapphire Rapids or later: family 6 with AVX-512 FP16 and AMX): without
//     prefetch the step took 1.16-1.20x the streaming floor (p += g, m += g, v += g) at 1
//     and 2 threads; 512 elements ahead, 1.01-1.03x (256 and 1024: within 2% of 512). The
//     floor itself gained nothing from the same prefetch, so it stays the floor.
// So the loop prefetches `Span::prefetch_ahead` elements ahead (cpu_adam.cpp starts from 512
// on Intel CPUs and 0 elsewhere; DeepSpeedCPUAdam then times both on its first large steps
// and keeps the faster, see deepspeed/ops/adam/cpu_adam.py) and stops `prefetch_ahead` short of the span's end, so it
// never touches memory outside the span. A prefetch changes no value: results are bitwise
// the same either way (tested).

// Element `at` of each of the four streams a step reads, into the cache (see the note above).
template <class PT, class GT>
DS_TARGET inline void prefetch_streams(const PT* p, const GT* g, const float* m, const float* v, int64_t at) {
  __builtin_prefetch(p + at);
  __builtin_prefetch(g + at);
  __builtin_prefetch(m + at);
  __builtin_prefetch(v + at);
}

template <class PT, class GT, class OT>
DS_TARGET void adam_span(const ds_adam::Span& t) {
  // Everything the loop reads from `t` and its scalars is copied into locals first: the
  // stores through float pointers could otherwise alias them, and the compiler would reload
  // each one on every iteration.
  PT* const p = static_cast<PT*>(t.param);
  const GT* const g = static_cast<const GT*>(t.grad);
  float* const m = t.exp_avg;
  float* const v = t.exp_avg_sq;
  OT* const o = static_cast<OT*>(t.out);
  const int64_t end = t.end;
  const ds_adam::Decay decay = t.scalars->decay;
  const bool from_avg = t.scalars->lerp_from_avg;
  const Consts c = broadcast(*t.scalars);
  const int64_t ahead = t.prefetch_ahead;
  int64_t i = t.begin;
  if (ahead > 0) {
    for (; i + ahead + V::W <= end; i += V::W) {
      prefetch_streams(p, g, m, v, i + ahead);
      adam_vector(p + i, g + i, m + i, v + i, offset(o, i), c, decay, from_avg);
    }
  }
  for (; i + V::W <= end; i += V::W) {
    adam_vector(p + i, g + i, m + i, v + i, offset(o, i), c, decay, from_avg);
  }
  const int64_t rest = end - i;
  if (rest == 0) return;
  // The tail (fewer than W elements) through one full vector on zeroed local copies, so
  // its rounding is the same as the body's.
  PT pb[V::W] = {};
  GT gb[V::W] = {};
  float mb[V::W] = {};
  float vb[V::W] = {};
  OT ob[V::W] = {};
  __builtin_memcpy(pb, p + i, rest * sizeof(PT));
  __builtin_memcpy(gb, g + i, rest * sizeof(GT));
  __builtin_memcpy(mb, m + i, rest * sizeof(float));
  __builtin_memcpy(vb, v + i, rest * sizeof(float));
  adam_vector(pb, gb, mb, vb, ob, c, decay, from_avg);
  __builtin_memcpy(p + i, pb, rest * sizeof(PT));
  __builtin_memcpy(m + i, mb, rest * sizeof(float));
  __builtin_memcpy(v + i, vb, rest * sizeof(float));
  if (TypeOf<OT>::value != ds_adam::Dtype::kNone) __builtin_memcpy(offset(o, i), ob, rest * sizeof(OT));
}

template <class PT, class GT>
DS_TARGET void adam_span_out(const ds_adam::Span& t) {
  switch (t.out_type) {
    case ds_adam::Dtype::kBF16: return adam_span<PT, GT, Bf16>(t);
    case ds_adam::Dtype::kF16: return adam_span<PT, GT, Half>(t);
    case ds_adam::Dtype::kF32: return adam_span<PT, GT, float>(t);
    default: return adam_span<PT, GT, NoOut>(t);
  }
}

// The type combinations the bindings allow: fp32 params with fp32/bf16/fp16 grads and any
// copy-out; bf16 (fp16) params with fp32 or bf16 (fp16) grads, updated in place.
DS_TARGET void adam_any(const ds_adam::Span& t) {
  using ds_adam::Dtype;
  if (t.param_type == Dtype::kF32) {
    if (t.grad_type == Dtype::kBF16) return adam_span_out<float, Bf16>(t);
    if (t.grad_type == Dtype::kF16) return adam_span_out<float, Half>(t);
    return adam_span_out<float, float>(t);
  }
  if (t.param_type == Dtype::kBF16) {
    if (t.grad_type == Dtype::kBF16) return adam_span<Bf16, Bf16, NoOut>(t);
    return adam_span<Bf16, float, NoOut>(t);
  }
  if (t.grad_type == Dtype::kF16) return adam_span<Half, Half, NoOut>(t);
  return adam_span<Half, float, NoOut>(t);
}

// [Note: the bandwidth floor]
// What the hardware allows for a step's bytes: p += g, m += g, v += g, the same four loads
// and three stores per element as an Adam step (param and grad of one type), all loads of a
// vector before its stores, and nothing else. kStream writes with non-temporal stores (x86;
// elsewhere plain stores), and the span's `prefetch_ahead` prefetches as the step's loop
// does; the benchmark takes whichever variant is fastest, so the floor is the best of them.
// Timings of it are bytes / time: the memory bandwidth for this access pattern.
template <bool kStream, class T>
DS_TARGET inline void floor_vector(T* p, const T* g, float* m, float* v) {
  const typename V::F param = V::ld(p);
  const typename V::F grad = V::ld(g);
  const typename V::F avg = V::ld(m);
  const typename V::F sq = V::ld(v);
  if (kStream) {
    V::stream(m, V::add(avg, grad));
    V::stream(v, V::add(sq, grad));
    V::stream(p, V::add(param, grad));
  } else {
    V::st(m, V::add(avg, grad));
    V::st(v, V::add(sq, grad));
    V::st(p, V::add(param, grad));
  }
}

template <bool kStream, class T>
DS_TARGET void floor_span(const ds_adam::Span& t) {
  T* const p = static_cast<T*>(t.param);
  const T* const g = static_cast<const T*>(t.grad);
  float* const m = t.exp_avg;
  float* const v = t.exp_avg_sq;
  const int64_t end = t.end;
  const int64_t ahead = t.prefetch_ahead;
  int64_t i = t.begin;
  if (ahead > 0) {
    for (; i + ahead + V::W <= end; i += V::W) {
      prefetch_streams(p, g, m, v, i + ahead);
      floor_vector<kStream>(p + i, g + i, m + i, v + i);
    }
  }
  for (; i + V::W <= end; i += V::W) floor_vector<kStream>(p + i, g + i, m + i, v + i);
  if (kStream) V::fence();
  const int64_t rest = end - i;
  if (rest == 0) return;
  T pb[V::W] = {};
  T gb[V::W] = {};
  float mb[V::W] = {};
  float vb[V::W] = {};
  __builtin_memcpy(pb, p + i, rest * sizeof(T));
  __builtin_memcpy(gb, g + i, rest * sizeof(T));
  __builtin_memcpy(mb, m + i, rest * sizeof(float));
  __builtin_memcpy(vb, v + i, rest * sizeof(float));
  floor_vector<false>(pb, gb, mb, vb);
  __builtin_memcpy(p + i, pb, rest * sizeof(T));
  __builtin_memcpy(m + i, mb, rest * sizeof(float));
  __builtin_memcpy(v + i, vb, rest * sizeof(float));
}

// Non-temporal stores need each vector's address aligned to its width.
template <class T>
inline bool stream_aligned(const ds_adam::Span& t) {
  const auto fits = [&](const void* base, int64_t elem) {
    return (reinterpret_cast<uintptr_t>(base) + t.begin * elem) % (V::W * elem) == 0;
  };
  return fits(t.param, sizeof(T)) && fits(t.exp_avg, sizeof(float)) && fits(t.exp_avg_sq, sizeof(float));
}

template <class T>
DS_TARGET void floor_typed(const ds_adam::Span& t, bool stream) {
  if (stream && stream_aligned<T>(t)) return floor_span<true, T>(t);
  return floor_span<false, T>(t);
}

DS_TARGET void floor_any(const ds_adam::Span& t, bool stream) {
  using ds_adam::Dtype;
  if (t.param_type == Dtype::kBF16) return floor_typed<Bf16>(t, stream);
  if (t.param_type == Dtype::kF16) return floor_typed<Half>(t, stream);
  return floor_typed<float>(t, stream);
}
