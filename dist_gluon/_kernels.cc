// Fused kernels of dist_gluon's per-step path (the 2-bit, onebit, PowerSGD and fp16
// codecs, ps-lite's exact float64 sum): pushed onto MXNet's engine as tasks
// (dg_task_new / dg_task_run, see "engine tasks"), and registered as operators of a
// library loaded with mx.library.load (MXNet's custom-operator library API, lib_api.h
// of the installed wheel).
//
// dg_twobit_quantize(grad, residual) -> words   (residual updated in place)
//     r += g; code = +1 if r >= t, -1 if r <= -t, else 0; r -= code * t
//     word w holds (code[j * words + w] + 1) << (width * j) for j < per_word
// dg_twobit_dequantize(words) -> values          (size elements)
//     value[j * words + w] = (((word[w] >> (width * j)) & mask) - workers) * t
//
// dg_onebit_worker(g, momentum, error) -> message    (momentum and error updated)
//     BytePS's onebit on a worker: Nesterov momentum and error feedback as the operator
//     path computes them; message = words of 24 sign bits (element i is bit i % 24 of
//     float32 word i / 24) then the scale, float32(mean |p| in double) or 1
// dg_onebit_server(rows, error) -> result              (the server's error updated)
//     every worker's message decompressed and added in rank order, the server's error
//     feedback, its reply compressed and decompressed
// dg_float64_split(x) -> wire                     (attrs workers, rank)
//     ps-lite's exact float64 sum: wire (workers, 3, size) float32, zero but for this
//     rank's row: hi = float(x), mid = float(x - hi), lo = float(x - hi - mid)
// dg_float64_combine(wire) -> total               (float64)
//     total[i] = sum over rows r, in order, of (hi_r + mid_r) + lo_r, in double
// dg_powersgd_project(grad, error, qt) -> pt        (float32; error updated)
//     e += g;  pt[k][i] = sum_j e[i][j] qt[k][j]       (P^T = Q^T M^T, M = e)
// dg_powersgd_approximate(basis, qt, error) -> approx   (attr workers; error updated)
//     approx[i][j] = sum_k basis[k][i] qt[k][j];  e[i][j] += -1/workers * approx[i][j]
// dg_fp16_pack(x) -> wire,  dg_fp16_unpack(wire) -> x      (float32 <-> float16)
//     IEEE round to nearest even, as MXNet's Cast: the F16C instructions where the CPU
//     has them, else (or with attr portable=1) the same rounding in integer arithmetic
//
// One pass over memory each, where the stock operators need about ten (PowerSGD: two,
// where the operators need five). The codecs' arithmetic is exactly the operator
// path's (and MXNet's own kernel's), in the gradient's dtype: compile without
// -ffast-math. PowerSGD's sums are float32 in another order than BLAS's, so its results
// agree with the operators' within float32 rounding, not to the bit.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DG_X86 1
#endif
#include <string>
#include <unordered_map>
#include <vector>

#include "mxnet/lib_api.h"

using namespace mxnet::ext;

namespace {

typedef std::unordered_map<std::string, std::string> Attrs;

int64_t attr_int(const Attrs& attrs, const char* name) {
  return std::stoll(attrs.at(name));
}

double attr_float(const Attrs& attrs, const char* name) {
  return std::stod(attrs.at(name));
}

int64_t elements(const std::vector<unsigned int>& shape) {
  int64_t size = 1;
  for (unsigned int d : shape) size *= d;
  return size;
}

// every operator's parseAttrs: its numbers of inputs and outputs
template <int In, int Out>
MXReturnValue parse(const Attrs& attrs, int* num_in, int* num_out) {
  *num_in = In;
  *num_out = Out;
  return MX_SUCCESS;
}

const int64_t kBlock = 256;   // words packed at once: their fields stay in L1

template <typename T, typename W>
void quantize(const T* grad, T* residual, W* words, int64_t size, int64_t n_words,
              int width, int per_word, T t) {
  const T minus_t = -t;
  uint32_t acc[kBlock];
  for (int64_t w0 = 0; w0 < n_words; w0 += kBlock) {
    const int64_t len = std::min(kBlock, n_words - w0);
    for (int64_t k = 0; k < len; ++k) acc[k] = 0;
    for (int j = 0; j < per_word; ++j) {
      const int64_t base = j * n_words + w0;
      const int shift = width * j;
      const int64_t inside = std::max<int64_t>(0, std::min(len, size - base));
      T* __restrict__ r = residual + base;
      const T* __restrict__ g = grad + base;
      uint32_t* __restrict__ a = acc;
      for (int64_t k = 0; k < inside; ++k) {
        // selects, not branches, so that the compiler vectorises the loop
        const T v = r[k] + g[k];
        const bool pos = v >= t, neg = v <= minus_t;
        const T up = v - t, down = v + t;
        const T sent = pos ? up : v;
        r[k] = neg ? down : sent;
        a[k] |= (1u + static_cast<uint32_t>(pos) - static_cast<uint32_t>(neg)) << shift;
      }
      for (int64_t k = inside; k < len; ++k) acc[k] |= 1u << shift;   // padding: code 0
    }
    for (int64_t k = 0; k < len; ++k) words[w0 + k] = static_cast<W>(acc[k]);
  }
}

template <typename T, typename W>
void dequantize(const W* words, T* out, int64_t size, int64_t n_words, int width,
                int per_word, int workers, T t) {
  const uint32_t mask = (1u << width) - 1;
  for (int j = 0; j < per_word; ++j) {
    const int64_t base = j * n_words;
    const int64_t inside = std::max<int64_t>(0, std::min(n_words, size - base));
    const int shift = width * j;
    T* o = out + base;
    for (int64_t k = 0; k < inside; ++k) {
      const uint32_t x = static_cast<uint32_t>(words[k]);
      const int field = static_cast<int>((x >> shift) & mask) - workers;
      o[k] = static_cast<T>(field) * t;
    }
  }
}

template <typename T>
MXReturnValue quantize_as(const Attrs& attrs, std::vector<MXTensor>* inputs,
                          std::vector<MXTensor>* outputs) {
  MXTensor& grad = (*inputs)[0];
  MXTensor& residual = (*inputs)[1];
  MXTensor& words = (*outputs)[0];
  const int width = attr_int(attrs, "width"), per_word = attr_int(attrs, "per_word");
  const T t = static_cast<T>(attr_float(attrs, "threshold"));
  if (words.dtype == kInt32) {
    quantize(grad.data<T>(), residual.data<T>(), words.data<int32_t>(), grad.size(),
             words.size(), width, per_word, t);
  } else {
    quantize(grad.data<T>(), residual.data<T>(), words.data<float>(), grad.size(),
             words.size(), width, per_word, t);
  }
  return MX_SUCCESS;
}

template <typename T>
MXReturnValue dequantize_as(const Attrs& attrs, std::vector<MXTensor>* inputs,
                            std::vector<MXTensor>* outputs) {
  MXTensor& words = (*inputs)[0];
  MXTensor& out = (*outputs)[0];
  const int width = attr_int(attrs, "width"), per_word = attr_int(attrs, "per_word");
  const int workers = attr_int(attrs, "workers");
  const T t = static_cast<T>(attr_float(attrs, "threshold"));
  if (words.dtype == kInt32) {
    dequantize(words.data<int32_t>(), out.data<T>(), out.size(), words.size(), width,
               per_word, workers, t);
  } else {
    dequantize(words.data<float>(), out.data<T>(), out.size(), words.size(), width,
               per_word, workers, t);
  }
  return MX_SUCCESS;
}

bool carrier_ok(int dtype) { return dtype == kInt32 || dtype == kFloat32; }
bool value_ok(int dtype) { return dtype == kFloat32 || dtype == kFloat64; }

// ------------------------------------------------------------------ quantize
MXReturnValue quantize_forward(const Attrs& attrs, std::vector<MXTensor>* inputs,
                               std::vector<MXTensor>* outputs, const OpResource& res) {
  if ((*inputs)[0].dtype == kFloat64) return quantize_as<double>(attrs, inputs, outputs);
  return quantize_as<float>(attrs, inputs, outputs);
}

MXReturnValue quantize_type(const Attrs& attrs, std::vector<int>* in_types,
                            std::vector<int>* out_types) {
  const int carrier = attrs.at("carrier") == "int32" ? kInt32 : kFloat32;
  if (!value_ok((*in_types)[0]) || (*in_types)[1] != (*in_types)[0]) {
    MX_ERROR_MSG << "dg_twobit_quantize: grad and residual must both be float32 or float64";
    return MX_FAIL;
  }
  (*out_types)[0] = carrier;
  return MX_SUCCESS;
}

MXReturnValue quantize_shape(const Attrs& attrs,
                             std::vector<std::vector<unsigned int>>* in_shapes,
                             std::vector<std::vector<unsigned int>>* out_shapes) {
  const int64_t size = elements((*in_shapes)[0]);
  if (elements((*in_shapes)[1]) != size) {
    MX_ERROR_MSG << "dg_twobit_quantize: the residual must have the gradient's size";
    return MX_FAIL;
  }
  const int64_t per_word = attr_int(attrs, "per_word");
  (*out_shapes)[0] = {static_cast<unsigned int>((size + per_word - 1) / per_word)};
  return MX_SUCCESS;
}

MXReturnValue quantize_mutates(const Attrs& attrs, std::vector<int>* input_indices) {
  input_indices->push_back(1);   // the residual
  return MX_SUCCESS;
}

// ------------------------------------------------------------------ dequantize
MXReturnValue dequantize_forward(const Attrs& attrs, std::vector<MXTensor>* inputs,
                                 std::vector<MXTensor>* outputs, const OpResource& res) {
  if ((*outputs)[0].dtype == kFloat64) return dequantize_as<double>(attrs, inputs, outputs);
  return dequantize_as<float>(attrs, inputs, outputs);
}

MXReturnValue dequantize_type(const Attrs& attrs, std::vector<int>* in_types,
                              std::vector<int>* out_types) {
  if (!carrier_ok((*in_types)[0])) {
    MX_ERROR_MSG << "dg_twobit_dequantize: words must be int32 or float32";
    return MX_FAIL;
  }
  (*out_types)[0] = attrs.at("dtype") == "float64" ? kFloat64 : kFloat32;
  return MX_SUCCESS;
}

MXReturnValue dequantize_shape(const Attrs& attrs,
                               std::vector<std::vector<unsigned int>>* in_shapes,
                               std::vector<std::vector<unsigned int>>* out_shapes) {
  (*out_shapes)[0] = {static_cast<unsigned int>(attr_int(attrs, "size"))};
  return MX_SUCCESS;
}


// ------------------------------------------------------------------ onebit
const int kSignBits = 24;     // exact integers of a float32 word

// mean(|x|) in double, as a float32 (1 without scaling): four running sums, so the
// additions overlap (the float32 scale is the same but for the last bit of a double,
// as with any order)
template <typename T>
float onebit_scale(const T* x, int64_t size, bool scaling) {
  if (!scaling) return 1.0f;
  double part[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t i = 0;
  for (; i + 4 <= size; i += 4) {
    for (int k = 0; k < 4; ++k) part[k] += std::fabs(static_cast<double>(x[i + k]));
  }
  for (; i < size; ++i) part[0] += std::fabs(static_cast<double>(x[i]));
  const double total = (part[0] + part[1]) + (part[2] + part[3]);
  return static_cast<float>(total / static_cast<double>(size));
}

// element i's sign (x < 0) as bit i % 24 of float32 word i / 24, then the scale
template <typename T>
void onebit_pack(const T* x, int64_t size, float scale, float* message) {
  const int64_t n_words = (size + kSignBits - 1) / kSignBits, full = size / kSignBits;
  for (int64_t w = 0; w < full; ++w) {
    const T* b = x + w * kSignBits;
    uint32_t bits = 0;
    for (int j = 0; j < kSignBits; ++j) bits |= static_cast<uint32_t>(b[j] < 0) << j;
    message[w] = static_cast<float>(bits);
  }
  if (full < n_words) {
    uint32_t bits = 0;
    for (int64_t i = full * kSignBits; i < size; ++i) {
      bits |= static_cast<uint32_t>(x[i] < 0) << (i - full * kSignBits);
    }
    message[full] = static_cast<float>(bits);
  }
  message[n_words] = scale;
}

// A worker's turn: momentum, the kept error, the message, the new error. The operator
// path's float arithmetic in the tensor's dtype, element by element:
//     m = g + mu * m;  p = g + mu * m            (momentum=1)
//     p = p + e  (ratio 1)  or  p + ratio * e    (ef=1)
//     message = signs of p, scale;  e = p - (p < 0 ? -scale : scale)   (ef=1)
// ``work`` holds e (ef=1) or is scratch for p.
template <typename T>
MXReturnValue onebit_worker_as(const Attrs& attrs, std::vector<MXTensor>* inputs,
                               std::vector<MXTensor>* outputs) {
  const T* g = (*inputs)[0].data<T>();
  T* m = (*inputs)[1].data<T>();
  T* work = (*inputs)[2].data<T>();
  const int64_t size = (*inputs)[0].size();
  const bool momentum = attr_int(attrs, "momentum"), ef = attr_int(attrs, "ef");
  const T mu = static_cast<T>(attr_float(attrs, "mu"));
  const double ratio_d = attr_float(attrs, "ratio");
  const T ratio = static_cast<T>(ratio_d);
  for (int64_t i = 0; i < size; ++i) {
    T p = g[i];
    if (momentum) {
      const T next = g[i] + mu * m[i];
      m[i] = next;
      p = g[i] + mu * next;
    }
    if (ef) p = ratio_d == 1.0 ? p + work[i] : p + ratio * work[i];
    work[i] = p;
  }
  const float scale = onebit_scale(work, size, attr_int(attrs, "scaling"));
  onebit_pack(work, size, scale, (*outputs)[0].data<float>());
  if (ef) {
    const T up = static_cast<T>(scale), down = static_cast<T>(-scale);
    for (int64_t i = 0; i < size; ++i) work[i] = work[i] - (work[i] < 0 ? down : up);
  }
  return MX_SUCCESS;
}

MXReturnValue onebit_worker_forward(const Attrs& attrs, std::vector<MXTensor>* inputs,
                                    std::vector<MXTensor>* outputs, const OpResource& res) {
  if ((*inputs)[0].dtype == kFloat64) return onebit_worker_as<double>(attrs, inputs, outputs);
  return onebit_worker_as<float>(attrs, inputs, outputs);
}

MXReturnValue onebit_worker_type(const Attrs& attrs, std::vector<int>* in_types,
                                 std::vector<int>* out_types) {
  const int dtype = (*in_types)[0];
  if (!value_ok(dtype) || (*in_types)[1] != dtype || (*in_types)[2] != dtype) {
    MX_ERROR_MSG << "dg_onebit_worker: the gradient, momentum and error must all be "
                    "float32 or all float64";
    return MX_FAIL;
  }
  (*out_types)[0] = kFloat32;
  return MX_SUCCESS;
}

MXReturnValue onebit_worker_shape(const Attrs& attrs,
                                  std::vector<std::vector<unsigned int>>* in_shapes,
                                  std::vector<std::vector<unsigned int>>* out_shapes) {
  const int64_t size = elements((*in_shapes)[0]);
  if (size == 0 || elements((*in_shapes)[1]) != size || elements((*in_shapes)[2]) != size) {
    MX_ERROR_MSG << "dg_onebit_worker: the gradient, momentum and error must have the same "
                    "(non-zero) size";
    return MX_FAIL;
  }
  (*out_shapes)[0] = {static_cast<unsigned int>((size + kSignBits - 1) / kSignBits + 1)};
  return MX_SUCCESS;
}

MXReturnValue onebit_worker_mutates(const Attrs& attrs, std::vector<int>* input_indices) {
  input_indices->push_back(1);   // momentum
  input_indices->push_back(2);   // error
  return MX_SUCCESS;
}

// The server's turn on every worker: the messages decompressed and added in rank order,
// the server's error, its reply compressed and decompressed:
//     q = sum_r (bit_r ? -scale_r : scale_r) [+ e or + ratio * e];
//     result = q < 0 ? -scale(q) : scale(q);  e = q - result
template <typename T>
MXReturnValue onebit_server_as(const Attrs& attrs, std::vector<MXTensor>* inputs,
                               std::vector<MXTensor>* outputs) {
  MXTensor& rows = (*inputs)[0];
  const float* message = rows.data<float>();
  T* e = (*inputs)[1].data<T>();
  T* out = (*outputs)[0].data<T>();
  const int64_t n_rows = rows.shape[0], width = rows.shape[1], n_words = width - 1;
  const int64_t size = (*outputs)[0].size();
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* row = message + r * width;
    const T up = static_cast<T>(row[n_words]), down = static_cast<T>(-row[n_words]);
    for (int64_t w = 0; w < n_words; ++w) {
      const uint32_t bits = static_cast<uint32_t>(row[w]);
      const int64_t lo = w * kSignBits, len = std::min<int64_t>(size - lo, kSignBits);
      T* o = out + lo;
      if (r == 0) {
        for (int64_t i = 0; i < len; ++i) o[i] = (bits >> i) & 1u ? down : up;
      } else {
        for (int64_t i = 0; i < len; ++i) o[i] = o[i] + ((bits >> i) & 1u ? down : up);
      }
    }
  }
  const bool ef = attr_int(attrs, "ef");
  const double ratio_d = attr_float(attrs, "ratio");
  const T ratio = static_cast<T>(ratio_d);
  if (ef) {
    for (int64_t i = 0; i < size; ++i) {
      out[i] = ratio_d == 1.0 ? out[i] + e[i] : out[i] + ratio * e[i];
    }
  }
  const float scale = onebit_scale(out, size, attr_int(attrs, "scaling"));
  const T up = static_cast<T>(scale), down = static_cast<T>(-scale);
  for (int64_t i = 0; i < size; ++i) {
    const T q = out[i], result = q < 0 ? down : up;
    if (ef) e[i] = q - result;
    out[i] = result;
  }
  return MX_SUCCESS;
}

MXReturnValue onebit_server_forward(const Attrs& attrs, std::vector<MXTensor>* inputs,
                                    std::vector<MXTensor>* outputs, const OpResource& res) {
  if ((*outputs)[0].dtype == kFloat64) return onebit_server_as<double>(attrs, inputs, outputs);
  return onebit_server_as<float>(attrs, inputs, outputs);
}

MXReturnValue onebit_server_type(const Attrs& attrs, std::vector<int>* in_types,
                                 std::vector<int>* out_types) {
  const int dtype = attrs.at("dtype") == "float64" ? kFloat64 : kFloat32;
  if ((*in_types)[0] != kFloat32 || (*in_types)[1] != dtype) {
    MX_ERROR_MSG << "dg_onebit_server: the messages must be float32 and the server's "
                    "error of the gradient's dtype";
    return MX_FAIL;
  }
  (*out_types)[0] = dtype;
  return MX_SUCCESS;
}

MXReturnValue onebit_server_shape(const Attrs& attrs,
                                  std::vector<std::vector<unsigned int>>* in_shapes,
                                  std::vector<std::vector<unsigned int>>* out_shapes) {
  const std::vector<unsigned int>& rows = (*in_shapes)[0];
  const int64_t size = attr_int(attrs, "size");
  if (rows.size() != 2 || rows[0] < 1 ||
      static_cast<int64_t>(rows[1]) != (size + kSignBits - 1) / kSignBits + 1 ||
      elements((*in_shapes)[1]) != size) {
    MX_ERROR_MSG << "dg_onebit_server: rows must be (workers, words + 1) and the server's "
                 << "error " << size << " elements";
    return MX_FAIL;
  }
  (*out_shapes)[0] = {static_cast<unsigned int>(size)};
  return MX_SUCCESS;
}

MXReturnValue onebit_server_mutates(const Attrs& attrs, std::vector<int>* input_indices) {
  input_indices->push_back(1);   // the server's error
  return MX_SUCCESS;
}

// ------------------------------------------------------------------ exact float64 sums
MXReturnValue split_forward(const Attrs& attrs, std::vector<MXTensor>* inputs,
                            std::vector<MXTensor>* outputs, const OpResource& res) {
  MXTensor& x = (*inputs)[0];
  const double* in = x.data<double>();
  const int64_t size = x.size();
  const int64_t workers = attr_int(attrs, "workers"), rank = attr_int(attrs, "rank");
  float* wire = (*outputs)[0].data<float>();
  for (int64_t r = 0; r < workers; ++r) {
    if (r == rank) continue;
    std::fill(wire + r * 3 * size, wire + (r + 1) * 3 * size, 0.0f);
  }
  float* hi = wire + rank * 3 * size;
  float* mid = hi + size;
  float* lo = mid + size;
  for (int64_t i = 0; i < size; ++i) {
    const double v = in[i];
    const float h = static_cast<float>(v);
    const double rest = v - static_cast<double>(h);
    const float m = static_cast<float>(rest);
    hi[i] = h;
    mid[i] = m;
    lo[i] = static_cast<float>(rest - static_cast<double>(m));
  }
  return MX_SUCCESS;
}

MXReturnValue split_type(const Attrs& attrs, std::vector<int>* in_types,
                         std::vector<int>* out_types) {
  if ((*in_types)[0] != kFloat64) {
    MX_ERROR_MSG << "dg_float64_split: the array must be float64";
    return MX_FAIL;
  }
  (*out_types)[0] = kFloat32;
  return MX_SUCCESS;
}

MXReturnValue split_shape(const Attrs& attrs,
                          std::vector<std::vector<unsigned int>>* in_shapes,
                          std::vector<std::vector<unsigned int>>* out_shapes) {
  const int64_t size = elements((*in_shapes)[0]);
  const int64_t workers = attr_int(attrs, "workers"), rank = attr_int(attrs, "rank");
  if (workers < 1 || rank < 0 || rank >= workers) {
    MX_ERROR_MSG << "dg_float64_split: rank " << rank << " of " << workers << " workers";
    return MX_FAIL;
  }
  (*out_shapes)[0] = {static_cast<unsigned int>(workers), 3u,
                      static_cast<unsigned int>(size)};
  return MX_SUCCESS;
}

MXReturnValue combine_forward(const Attrs& attrs, std::vector<MXTensor>* inputs,
                              std::vector<MXTensor>* outputs, const OpResource& res) {
  MXTensor& wire = (*inputs)[0];
  const float* w = wire.data<float>();
  const int64_t workers = wire.shape[0], size = wire.shape[2];
  double* out = (*outputs)[0].data<double>();
  for (int64_t r = 0; r < workers; ++r) {
    const float* hi = w + r * 3 * size;
    const float* mid = hi + size;
    const float* lo = mid + size;
    if (r == 0) {
      for (int64_t i = 0; i < size; ++i) {
        out[i] = (static_cast<double>(hi[i]) + static_cast<double>(mid[i]))
                 + static_cast<double>(lo[i]);
      }
    } else {
      for (int64_t i = 0; i < size; ++i) {
        out[i] = out[i] + ((static_cast<double>(hi[i]) + static_cast<double>(mid[i]))
                           + static_cast<double>(lo[i]));
      }
    }
  }
  return MX_SUCCESS;
}

MXReturnValue combine_type(const Attrs& attrs, std::vector<int>* in_types,
                           std::vector<int>* out_types) {
  if ((*in_types)[0] != kFloat32) {
    MX_ERROR_MSG << "dg_float64_combine: the wire must be float32";
    return MX_FAIL;
  }
  (*out_types)[0] = kFloat64;
  return MX_SUCCESS;
}

MXReturnValue combine_shape(const Attrs& attrs,
                            std::vector<std::vector<unsigned int>>* in_shapes,
                            std::vector<std::vector<unsigned int>>* out_shapes) {
  const std::vector<unsigned int>& wire = (*in_shapes)[0];
  if (wire.size() != 3 || wire[1] != 3u || wire[0] < 1) {
    MX_ERROR_MSG << "dg_float64_combine: the wire must be (workers, 3, size)";
    return MX_FAIL;
  }
  (*out_shapes)[0] = {wire[2]};
  return MX_SUCCESS;
}

// ------------------------------------------------------------------ PowerSGD
// Rank by rank sums need independent running sums to vectorise without -ffast-math:
// two 4-float vectors per rank (GCC's vector extension, SSE2 everywhere), added up at
// the end of a row.
typedef float Floats __attribute__((vector_size(16)));
const int kLanes = 4;
const int kRanks = 8;    // ranks per pass over a row (more: the row again, from cache)

inline Floats load(const float* p) {
  Floats v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, Floats v) { std::memcpy(p, &v, sizeof v); }

// pt[k * n] for the R ranks of qt; Add: the row is e + g first (and stored)
template <int R, bool Add>
void project_row(const float* __restrict__ g, float* __restrict__ e,
                 const float* __restrict__ qt, int64_t m, float* pt, int64_t n) {
  Floats acc[R][2];
  for (int k = 0; k < R; ++k) acc[k][0] = acc[k][1] = Floats{0.0f, 0.0f, 0.0f, 0.0f};
  const int64_t body = m - m % (2 * kLanes);
  for (int64_t j = 0; j < body; j += 2 * kLanes) {
    Floats v0 = load(e + j), v1 = load(e + j + kLanes);
    if (Add) {
      v0 += load(g + j);
      v1 += load(g + j + kLanes);
      store(e + j, v0);
      store(e + j + kLanes, v1);
    }
    for (int k = 0; k < R; ++k) {
      acc[k][0] += v0 * load(qt + k * m + j);
      acc[k][1] += v1 * load(qt + k * m + j + kLanes);
    }
  }
  float total[R];
  for (int k = 0; k < R; ++k) {
    const Floats s = acc[k][0] + acc[k][1];
    total[k] = (s[0] + s[1]) + (s[2] + s[3]);
  }
  for (int64_t j = body; j < m; ++j) {
    const float v = Add ? e[j] + g[j] : e[j];
    if (Add) e[j] = v;
    for (int k = 0; k < R; ++k) total[k] += v * qt[k * m + j];
  }
  for (int k = 0; k < R; ++k) pt[k * n] = total[k];
}

template <bool Add>
void project_ranks(int ranks, const float* g, float* e, const float* qt, int64_t m,
                   float* pt, int64_t n) {
  switch (ranks) {
    case 1: return project_row<1, Add>(g, e, qt, m, pt, n);
    case 2: return project_row<2, Add>(g, e, qt, m, pt, n);
    case 3: return project_row<3, Add>(g, e, qt, m, pt, n);
    case 4: return project_row<4, Add>(g, e, qt, m, pt, n);
    case 5: return project_row<5, Add>(g, e, qt, m, pt, n);
    case 6: return project_row<6, Add>(g, e, qt, m, pt, n);
    case 7: return project_row<7, Add>(g, e, qt, m, pt, n);
    default: return project_row<kRanks, Add>(g, e, qt, m, pt, n);
  }
}

MXReturnValue project_forward(const Attrs& attrs, std::vector<MXTensor>* inputs,
                              std::vector<MXTensor>* outputs, const OpResource& res) {
  const float* g = (*inputs)[0].data<float>();
  float* e = (*inputs)[1].data<float>();
  MXTensor& qt = (*inputs)[2];
  const int64_t n = (*inputs)[1].shape[0], m = (*inputs)[1].shape[1], r = qt.shape[0];
  float* pt = (*outputs)[0].data<float>();
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t k0 = 0; k0 < r; k0 += kRanks) {
      const int ranks = static_cast<int>(std::min<int64_t>(kRanks, r - k0));
      const float* q = qt.data<float>() + k0 * m;
      if (k0 == 0) {
        project_ranks<true>(ranks, g + i * m, e + i * m, q, m, pt + k0 * n + i, n);
      } else {
        project_ranks<false>(ranks, g + i * m, e + i * m, q, m, pt + k0 * n + i, n);
      }
    }
  }
  return MX_SUCCESS;
}

// row i of approx = sum_k b[k] qt[k], then e_i += minus_share * approx_i
template <int R>
void approximate_row(const float* b, const float* __restrict__ qt, int64_t m,
                     float* __restrict__ out, float* __restrict__ e, float minus_share) {
  for (int64_t j = 0; j < m; ++j) {
    float a = b[0] * qt[j];
    for (int k = 1; k < R; ++k) a += b[k] * qt[k * m + j];
    out[j] = a;
    e[j] += minus_share * a;
  }
}

MXReturnValue approximate_forward(const Attrs& attrs, std::vector<MXTensor>* inputs,
                                  std::vector<MXTensor>* outputs, const OpResource& res) {
  MXTensor& basis = (*inputs)[0];
  const float* qt = (*inputs)[1].data<float>();
  float* e = (*inputs)[2].data<float>();
  float* out = (*outputs)[0].data<float>();
  const int64_t r = basis.shape[0], n = basis.shape[1], m = (*inputs)[1].shape[1];
  const float minus_share = static_cast<float>(-1.0 / attr_float(attrs, "workers"));
  std::vector<float> b(r);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t k = 0; k < r; ++k) b[k] = basis.data<float>()[k * n + i];
    float* o = out + i * m;
    float* er = e + i * m;
    switch (r) {
      case 1: approximate_row<1>(b.data(), qt, m, o, er, minus_share); break;
      case 2: approximate_row<2>(b.data(), qt, m, o, er, minus_share); break;
      case 3: approximate_row<3>(b.data(), qt, m, o, er, minus_share); break;
      case 4: approximate_row<4>(b.data(), qt, m, o, er, minus_share); break;
      case 5: approximate_row<5>(b.data(), qt, m, o, er, minus_share); break;
      case 6: approximate_row<6>(b.data(), qt, m, o, er, minus_share); break;
      case 7: approximate_row<7>(b.data(), qt, m, o, er, minus_share); break;
      case 8: approximate_row<8>(b.data(), qt, m, o, er, minus_share); break;
      default:     // higher ranks: the row again per rank, from cache
        for (int64_t j = 0; j < m; ++j) o[j] = b[0] * qt[j];
        for (int64_t k = 1; k < r; ++k) {
          const float* q = qt + k * m;
          for (int64_t j = 0; j < m; ++j) o[j] += b[k] * q[j];
        }
        for (int64_t j = 0; j < m; ++j) er[j] += minus_share * o[j];
    }
  }
  return MX_SUCCESS;
}

bool all_float32(const std::vector<int>& types) {
  for (int t : types) {
    if (t != kFloat32) return false;
  }
  return true;
}

MXReturnValue powersgd_type(const Attrs& attrs, std::vector<int>* in_types,
                            std::vector<int>* out_types) {
  if (!all_float32(*in_types)) {
    MX_ERROR_MSG << "dg_powersgd_project/approximate: every array must be float32";
    return MX_FAIL;
  }
  (*out_types)[0] = kFloat32;
  return MX_SUCCESS;
}

bool is_matrix(const std::vector<unsigned int>& shape) {
  return shape.size() == 2 && shape[0] > 0 && shape[1] > 0;
}

// grad (n, m), error (n, m), qt (r, m) -> pt (r, n)
MXReturnValue project_shape(const Attrs& attrs,
                            std::vector<std::vector<unsigned int>>* in_shapes,
                            std::vector<std::vector<unsigned int>>* out_shapes) {
  const std::vector<unsigned int>& g = (*in_shapes)[0];
  const std::vector<unsigned int>& e = (*in_shapes)[1];
  const std::vector<unsigned int>& qt = (*in_shapes)[2];
  if (!is_matrix(e) || g != e || !is_matrix(qt) || qt[1] != e[1]) {
    MX_ERROR_MSG << "dg_powersgd_project: grad and error must be (n, m) and qt (r, m)";
    return MX_FAIL;
  }
  (*out_shapes)[0] = {qt[0], e[0]};
  return MX_SUCCESS;
}

MXReturnValue project_mutates(const Attrs& attrs, std::vector<int>* input_indices) {
  input_indices->push_back(1);   // the error
  return MX_SUCCESS;
}

// basis (r, n), qt (r, m), error (n, m) -> approx (n, m)
MXReturnValue approximate_shape(const Attrs& attrs,
                                std::vector<std::vector<unsigned int>>* in_shapes,
                                std::vector<std::vector<unsigned int>>* out_shapes) {
  const std::vector<unsigned int>& basis = (*in_shapes)[0];
  const std::vector<unsigned int>& qt = (*in_shapes)[1];
  const std::vector<unsigned int>& e = (*in_shapes)[2];
  if (!is_matrix(basis) || !is_matrix(qt) || !is_matrix(e) || qt[0] != basis[0] ||
      e[0] != basis[1] || e[1] != qt[1]) {
    MX_ERROR_MSG << "dg_powersgd_approximate: basis must be (r, n), qt (r, m) and the "
                    "error (n, m)";
    return MX_FAIL;
  }
  (*out_shapes)[0] = e;
  return MX_SUCCESS;
}

MXReturnValue approximate_mutates(const Attrs& attrs, std::vector<int>* input_indices) {
  input_indices->push_back(2);   // the error
  return MX_SUCCESS;
}

// ------------------------------------------------------------------ float16
// float32 -> float16, round to nearest even (NaN stays NaN, quiet, its payload's top
// bits kept; beyond float16's range: infinity), as F16C's vcvtps2ph does
uint16_t half_of(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
  if (a >= 0x7f800000u) {
    return sign | (a > 0x7f800000u ? 0x7e00u | ((a >> 13) & 0x3ffu) : 0x7c00u);
  }
  if (a >= 0x477ff000u) return sign | 0x7c00u;            // rounds past 65504
  if (a < 0x38800000u) {                                  // below 2^-14: subnormal
    float v;
    std::memcpy(&v, &a, sizeof v);
    return sign | static_cast<uint16_t>(std::nearbyint(v * 16777216.0f));   // exact *2^24
  }
  const uint32_t rebased = a - 0x38000000u;               // exponent 127 -> 15
  return sign | static_cast<uint16_t>((rebased + 0xfffu + ((rebased >> 13) & 1u)) >> 13);
}

float float_of(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t x;
  if (exponent == 0x1fu) {
    x = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    x = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else {                                                // zero or subnormal: exact
    const float v = static_cast<float>(mantissa) * (1.0f / 16777216.0f);
    std::memcpy(&x, &v, sizeof x);
    x |= sign;
  }
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}

#ifdef DG_X86
__attribute__((target("avx,f16c")))
int64_t pack_f16c(const float* x, uint16_t* h, int64_t size) {
  int64_t i = 0;
  for (; i + 8 <= size; i += 8) {
    const __m128i v = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h + i), v);
  }
  return i;
}

__attribute__((target("avx,f16c")))
int64_t unpack_f16c(const uint16_t* h, float* x, int64_t size) {
  int64_t i = 0;
  for (; i + 8 <= size; i += 8) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i));
    _mm256_storeu_ps(x + i, _mm256_cvtph_ps(v));
  }
  return i;
}

bool has_f16c() {
  static const bool yes = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return yes;
}
#endif

bool portable(const Attrs& attrs) {
  return attrs.count("portable") && attr_int(attrs, "portable") != 0;
}

MXReturnValue fp16_pack_forward(const Attrs& attrs, std::vector<MXTensor>* inputs,
                                std::vector<MXTensor>* outputs, const OpResource& res) {
  const float* x = (*inputs)[0].data<float>();
  uint16_t* h = (*outputs)[0].data<uint16_t>();
  const int64_t size = (*inputs)[0].size();
  int64_t i = 0;
#ifdef DG_X86
  if (!portable(attrs) && has_f16c()) i = pack_f16c(x, h, size);
#endif
  for (; i < size; ++i) h[i] = half_of(x[i]);
  return MX_SUCCESS;
}

MXReturnValue fp16_unpack_forward(const Attrs& attrs, std::vector<MXTensor>* inputs,
                                  std::vector<MXTensor>* outputs, const OpResource& res) {
  const uint16_t* h = (*inputs)[0].data<uint16_t>();
  float* x = (*outputs)[0].data<float>();
  const int64_t size = (*inputs)[0].size();
  int64_t i = 0;
#ifdef DG_X86
  if (!portable(attrs) && has_f16c()) i = unpack_f16c(h, x, size);
#endif
  for (; i < size; ++i) x[i] = float_of(h[i]);
  return MX_SUCCESS;
}

template <int From, int To>
MXReturnValue convert_type(const Attrs& attrs, std::vector<int>* in_types,
                           std::vector<int>* out_types) {
  if ((*in_types)[0] != From) {
    MX_ERROR_MSG << "dg_fp16_pack takes float32 and dg_fp16_unpack float16";
    return MX_FAIL;
  }
  (*out_types)[0] = To;
  return MX_SUCCESS;
}

MXReturnValue same_shape(const Attrs& attrs,
                         std::vector<std::vector<unsigned int>>* in_shapes,
                         std::vector<std::vector<unsigned int>>* out_shapes) {
  (*out_shapes)[0] = (*in_shapes)[0];
  return MX_SUCCESS;
}

// ------------------------------------------------------------------ engine tasks
// The same kernels pushed straight onto MXNet's engine (MXEnginePushSyncND), reading and
// writing exactly the arrays given. A library operator also takes MXNet's temporary-
// space and parallel-random resources, and the CPU has one parallel-random copy
// (MXNET_CPU_PARALLEL_RAND_COPY): every library operator then waits for the one pushed
// before it, so a codec's decode, waiting for its sum, held back the next tensor's
// encode and its sum, one collective per cycle.
struct OpEntry {
  MXReturnValue (*forward)(const Attrs&, std::vector<MXTensor>*, std::vector<MXTensor>*,
                           const OpResource&);
  MXReturnValue (*parse)(const Attrs&, int*, int*);
  MXReturnValue (*type)(const Attrs&, std::vector<int>*, std::vector<int>*);
  MXReturnValue (*shape)(const Attrs&, std::vector<std::vector<unsigned int>>*,
                         std::vector<std::vector<unsigned int>>*);
  MXReturnValue (*mutates)(const Attrs&, std::vector<int>*);
};

// Every kernel, by its operator name
const std::unordered_map<std::string, OpEntry>& kernels() {
  static const std::unordered_map<std::string, OpEntry> table = {
      {"dg_twobit_quantize", {quantize_forward, parse<2, 1>, quantize_type, quantize_shape,
                              quantize_mutates}},
      {"dg_twobit_dequantize", {dequantize_forward, parse<1, 1>, dequantize_type,
                                dequantize_shape, nullptr}},
      {"dg_onebit_worker", {onebit_worker_forward, parse<3, 1>, onebit_worker_type,
                            onebit_worker_shape, onebit_worker_mutates}},
      {"dg_onebit_server", {onebit_server_forward, parse<2, 1>, onebit_server_type,
                            onebit_server_shape, onebit_server_mutates}},
      {"dg_float64_split", {split_forward, parse<1, 1>, split_type, split_shape, nullptr}},
      {"dg_float64_combine", {combine_forward, parse<1, 1>, combine_type, combine_shape,
                              nullptr}},
      {"dg_powersgd_project", {project_forward, parse<3, 1>, powersgd_type, project_shape,
                               project_mutates}},
      {"dg_powersgd_approximate", {approximate_forward, parse<3, 1>, powersgd_type,
                                   approximate_shape, approximate_mutates}},
      {"dg_fp16_pack", {fp16_pack_forward, parse<1, 1>, convert_type<kFloat32, kFloat16>,
                        same_shape, nullptr}},
      {"dg_fp16_unpack", {fp16_unpack_forward, parse<1, 1>, convert_type<kFloat16, kFloat32>,
                          same_shape, nullptr}},
  };
  return table;
}

const OpEntry* find_op(const std::string& name) {
  auto found = kernels().find(name);
  return found == kernels().end() ? nullptr : &found->second;
}

// Each kernel also as an MXNet library operator, mx.nd.<name> (what the tests and the
// stock-operator comparisons call), from the same table as the engine tasks
__attribute__((used)) const bool registered = [] {
  for (const auto& kernel : kernels()) {
    const OpEntry& op = kernel.second;
    CustomOp& entry = Registry<CustomOp>::get()->add(kernel.first.c_str());
    entry.setForward(op.forward, "cpu").setParseAttrs(op.parse).setInferType(op.type)
        .setInferShape(op.shape);
    if (op.mutates != nullptr) entry.setMutateInputs(op.mutates);
  }
  return true;
}();

typedef int (*GetData)(void* handle, void** data);   // MXNDArrayGetData
typedef int (*FreeHandle)(void* handle);             // MXNDArrayFree

// The arrays are the task's own handles (MXShallowCopyNDArray: the same memory, kept
// alive); their addresses are read when the task runs, after the engine ran every
// operation it depends on (an array MXNet allocates lazily is allocated by then).
struct Task {
  const OpEntry* op;
  Attrs attrs;
  std::vector<MXTensor> inputs, outputs;
  std::vector<void*> in_handles, out_handles;
  GetData get_data;
  FreeHandle free_handle;
};

thread_local std::string task_error;

}  // namespace

extern "C" {

const char* dg_task_error() { return task_error.c_str(); }

// Which inputs ``name`` writes (they go to the engine as mutable); -1 if no such op.
int dg_task_mutates(const char* name, int* indices, int capacity) {
  const OpEntry* op = find_op(name);
  if (op == nullptr) return -1;
  std::vector<int> mutated;
  if (op->mutates != nullptr) op->mutates(Attrs(), &mutated);
  for (size_t i = 0; i < mutated.size() && static_cast<int>(i) < capacity; ++i) {
    indices[i] = mutated[i];
  }
  return static_cast<int>(mutated.size());
}

// A task of operator ``name`` on the given CPU arrays, checked as the operator's type
// and shape functions check it (an output must have the inferred dtype and size); NULL
// with dg_task_error() set when it does not fit.
void* dg_task_new(const char* name, int n_attrs, const char** keys, const char** values,
                  int n_in, void** in_handles, const int* in_dtypes, const int* in_ndims,
                  const int64_t* in_dims, int n_out, void** out_handles,
                  const int* out_dtypes, const int64_t* out_sizes, GetData get_data,
                  FreeHandle free_handle) {
  const OpEntry* op = find_op(name);
  if (op == nullptr) {
    task_error = std::string("no fused kernel named ") + name;
    return nullptr;
  }
  Task* task = new Task();
  task->op = op;
  task->get_data = get_data;
  task->free_handle = free_handle;
  for (int i = 0; i < n_attrs; ++i) task->attrs[keys[i]] = values[i];
  try {
    int want_in = 0, want_out = 0;
    op->parse(task->attrs, &want_in, &want_out);
    if (want_in != n_in || want_out != n_out) {
      throw std::string(name) + " takes " + std::to_string(want_in) + " inputs and " +
          std::to_string(want_out) + " outputs";
    }
    std::vector<int> types(in_dtypes, in_dtypes + n_in), out_types(n_out, -1);
    std::vector<std::vector<unsigned int>> shapes(n_in), out_shapes(n_out);
    for (int i = 0, offset = 0; i < n_in; offset += in_ndims[i], ++i) {
      shapes[i].assign(in_dims + offset, in_dims + offset + in_ndims[i]);
    }
    const int before = MXerrorMsgs::get()->size();
    if (op->type(task->attrs, &types, &out_types) != MX_SUCCESS ||
        op->shape(task->attrs, &shapes, &out_shapes) != MX_SUCCESS) {
      // the type and shape functions' own message (MX_ERROR_MSG)
      const int after = MXerrorMsgs::get()->size();
      throw after > before ? *MXerrorMsgs::get()->get(after - 1)
                           : std::string(name) + ": the arrays do not fit";
    }
    for (int i = 0, offset = 0; i < n_in; offset += in_ndims[i], ++i) {
      std::vector<int64_t> dims(in_dims + offset, in_dims + offset + in_ndims[i]);
      task->inputs.emplace_back(nullptr, dims, static_cast<MXDType>(in_dtypes[i]), 0,
                                MXContext::CPU(0));
    }
    for (int i = 0; i < n_out; ++i) {
      std::vector<int64_t> dims(out_shapes[i].begin(), out_shapes[i].end());
      int64_t size = 1;
      for (int64_t d : dims) size *= d;
      if (out_types[i] != out_dtypes[i] || size != out_sizes[i]) {
        throw std::string(name) + ": output " + std::to_string(i) + " must have dtype " +
            std::to_string(out_types[i]) + " and " + std::to_string(size) +
            " elements, not dtype " + std::to_string(out_dtypes[i]) + " and " +
            std::to_string(out_sizes[i]);
      }
      task->outputs.emplace_back(nullptr, dims, static_cast<MXDType>(out_dtypes[i]), 0,
                                 MXContext::CPU(0));
    }
    // only now: on failure the caller still owns the handles
    task->in_handles.assign(in_handles, in_handles + n_in);
    task->out_handles.assign(out_handles, out_handles + n_out);
  } catch (const std::string& message) {
    task_error = message;
    delete task;
    return nullptr;
  } catch (const std::exception& err) {
    task_error = std::string(name) + ": " + err.what();
    delete task;
    return nullptr;
  }
  return task;
}

// EngineSyncFunc: runs the task on the engine's thread
void dg_task_run(void* run_context, void* param) {
  Task* task = static_cast<Task*>(param);
  for (size_t i = 0; i < task->inputs.size(); ++i) {
    task->get_data(task->in_handles[i], &task->inputs[i].data_ptr);
  }
  for (size_t i = 0; i < task->outputs.size(); ++i) {
    task->get_data(task->out_handles[i], &task->outputs[i].data_ptr);
  }
  OpResource none(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                  nullptr);
  task->op->forward(task->attrs, &task->inputs, &task->outputs, none);
}

// EngineFuncParamDeleter: after the task ran (or was dropped)
void dg_task_free(void* param) {
  Task* task = static_cast<Task*>(param);
  for (void* handle : task->in_handles) task->free_handle(handle);
  for (void* handle : task->out_handles) task->free_handle(handle);
  delete task;
}

}  // extern "C"

MXReturnValue initialize(int version) {
  return version >= 10700 ? MX_SUCCESS : MX_FAIL;
}
