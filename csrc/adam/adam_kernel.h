// The Adam step written once over a vector type, instantiated by each instruction-set file.
//
// Include this inside an anonymous namespace, after defining
//   DS_TARGET  a function attribute selecting the instruction set (may be empty), and
//   struct V   W lanes of float (V::F) with: ld/st overloads for float, Bf16, Half (and st
//              for NoOut, a no-op), set1, add, sub, mul, div, sqrt, and fmadd(a, b, c) = a*b+c
//              rounded once.
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
template <bool kProbe, class PT, class GT, class OT>
DS_TARGET inline void adam_vector(PT* p, const GT* g, float* m, float* v, OT* o, const Consts& c,
                                  ds_adam::Decay decay, bool from_avg) {
  typename V::F param = V::ld(p);
  typename V::F grad = V::ld(g);
  if (kProbe) {  // the bandwidth floor: the same loads and stores, one add each
    V::st(m, V::add(V::ld(m), grad));
    V::st(v, V::add(V::ld(v), grad));
    V::st(p, V::add(param, grad));
    return;
  }
  if (decay == ds_adam::Decay::kL2) {
    grad = V::fmadd(param, c.weight_decay, grad);
  } else if (decay == ds_adam::Decay::kDecoupled) {
    param = V::mul(param, c.decay_factor);
  }
  const typename V::F avg = V::ld(m);
  const typename V::F diff = V::sub(grad, avg);
  const typename V::F new_avg = V::fmadd(c.lerp_coeff, diff, from_avg ? avg : grad);
  const typename V::F new_sq = V::fmadd(V::mul(c.one_minus_beta2, grad), grad, V::mul(V::ld(v), c.beta2));
  const typename V::F denom = V::add(V::mul(V::sqrt(new_sq), c.inv_bc2_sqrt), c.eps);
  param = V::add(param, V::div(V::mul(c.neg_step, new_avg), denom));
  V::st(m, new_avg);
  V::st(v, new_sq);
  V::st(p, param);
  V::st(o, param);
}

// Elements ahead to prefetch (a few KiB per stream; prefetching past the end is harmless).
constexpr int64_t kPrefetch = 1024;

template <class PT, class GT, class OT, bool kProbe = false>
DS_TARGET void adam_span(const ds_adam::Span& t) {
  PT* p = static_cast<PT*>(t.param);
  const GT* g = static_cast<const GT*>(t.grad);
  OT* o = static_cast<OT*>(t.out);
  const ds_adam::Scalars& s = *t.scalars;
  const Consts c = broadcast(s);
  int64_t i = t.begin;
  for (; i + V::W <= t.end; i += V::W) {
    if (!kProbe) {  // fetch ahead: the divider's long chains otherwise limit loads in flight
      __builtin_prefetch(p + i + kPrefetch, 1);
      __builtin_prefetch(g + i + kPrefetch, 0);
      __builtin_prefetch(t.exp_avg + i + kPrefetch, 1);
      __builtin_prefetch(t.exp_avg_sq + i + kPrefetch, 1);
    }
    adam_vector<kProbe>(p + i, g + i, t.exp_avg + i, t.exp_avg_sq + i, offset(o, i), c, s.decay, s.lerp_from_avg);
  }
  const int64_t rest = t.end - i;
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
  __builtin_memcpy(mb, t.exp_avg + i, rest * sizeof(float));
  __builtin_memcpy(vb, t.exp_avg_sq + i, rest * sizeof(float));
  adam_vector<kProbe>(pb, gb, mb, vb, ob, c, s.decay, s.lerp_from_avg);
  __builtin_memcpy(p + i, pb, rest * sizeof(PT));
  __builtin_memcpy(t.exp_avg + i, mb, rest * sizeof(float));
  __builtin_memcpy(t.exp_avg_sq + i, vb, rest * sizeof(float));
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

// The bandwidth floor: param += grad, exp_avg += grad, exp_avg_sq += grad, with the loads
// and stores of an Adam step on the same types (no copy-out).
DS_TARGET void probe_any(const ds_adam::Span& t) {
  using ds_adam::Dtype;
  if (t.param_type == Dtype::kBF16) return adam_span<Bf16, Bf16, NoOut, true>(t);
  if (t.param_type == Dtype::kF16) return adam_span<Half, Half, NoOut, true>(t);
  return adam_span<float, float, NoOut, true>(t);
}
