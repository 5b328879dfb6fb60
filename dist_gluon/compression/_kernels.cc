// Fused 2-bit kernels for dist_gluon's compression, loaded with mx.library.load
// (MXNet's custom-operator library API, lib_api.h of the installed wheel).
//
// dg_twobit_quantize(grad, residual) -> words   (residual updated in place)
//     r += g; code = +1 if r >= t, -1 if r <= -t, else 0; r -= code * t
//     word w holds (code[j * words + w] + 1) << (width * j) for j < per_word
// dg_twobit_dequantize(words) -> values          (size elements)
//     value[j * words + w] = (((word[w] >> (width * j)) & mask) - workers) * t
//
// One pass over memory each, where the stock operators need about ten. The arithmetic
// is exactly the operator path's (and MXNet's own kernel's), in the gradient's dtype:
// compile without -ffast-math.
#include <algorithm>
#include <cmath>
#include <cstdint>
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

MXReturnValue quantize_parse(const Attrs& attrs, int* num_in, int* num_out) {
  *num_in = 2;
  *num_out = 1;
  return MX_SUCCESS;
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
  int64_t size = 1;
  for (unsigned int d : (*in_shapes)[0]) size *= d;
  int64_t residual = 1;
  for (unsigned int d : (*in_shapes)[1]) residual *= d;
  if (residual != size) {
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

MXReturnValue dequantize_parse(const Attrs& attrs, int* num_in, int* num_out) {
  *num_in = 1;
  *num_out = 1;
  return MX_SUCCESS;
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

}  // namespace

REGISTER_OP(dg_twobit_quantize)
.setForward(quantize_forward, "cpu")
.setParseAttrs(quantize_parse)
.setInferType(quantize_type)
.setInferShape(quantize_shape)
.setMutateInputs(quantize_mutates);

REGISTER_OP(dg_twobit_dequantize)
.setForward(dequantize_forward, "cpu")
.setParseAttrs(dequantize_parse)
.setInferType(dequantize_type)
.setInferShape(dequantize_shape);

MXReturnValue initialize(int version) {
  return version >= 10700 ? MX_SUCCESS : MX_FAIL;
}
