// The ELMo LSTM cell's elementwise work in one pass over its gates (elmokit.model.fused_cell builds and
// calls this file; the formulas are elmokit/model/cell.py's):
//
//     c_t = clip(σ(f) * c_{t-1} + σ(i) * tanh(j), cell_clip)      m_t = σ(o) * tanh(c_t)
//
// from the pre-activations (i, f, o, 2j) of one step, the candidate arriving doubled as the engine
// computes it (tanh(j) = 2 σ(2j) - 1, as `tanh_via_sigmoid`). The gates come in float32 or in
// bfloat16, whole or as two terms added here (the recurrent product and the gate inputs), or as
// int8 products' int32 sums with their scales (dequantized here, never written as float32); c_t
// replaces c_{t-1} in place, m_t is written in float32 or bfloat16 (the projection's input). Eager
// torch makes about a dozen passes over the step's 4C gates for this.
//
// exp is computed here (range reduction to [-ln2/2, ln2/2] and a degree-6 polynomial: relative
// error under 2 float32 ulps) so that the compiler vectorizes the loop without -ffast-math.
// Threads: OpenMP (the process's own runtime, libgomp, shared with torch), over blocks of columns.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int64_t kBlock = 512;  // columns of one work item

inline float bf16_to_float(uint16_t value) {
    uint32_t bits = uint32_t(value) << 16;
    float result;
    std::memcpy(&result, &bits, sizeof(result));
    return result;
}

inline uint16_t float_to_bf16(float value) {  // round to nearest even, as torch's .to(torch.bfloat16)
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40u);  // NaN stays NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return uint16_t(bits >> 16);
}

inline float to_float(float value) { return value; }
inline float to_float(uint16_t value) { return bf16_to_float(value); }

inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float shifted = x * 1.44269504088896341f + 12582912.0f;  // 1.5 * 2^23: rounds to an integer
    const float n = shifted - 12582912.0f;                             // round(x / ln 2)
    const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;  // ln 2 in two parts
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t bits; float value; } scale;  // 2^n
    scale.value = shifted;
    scale.bits = (scale.bits - 0x4B400000 + 127) << 23;
    return p * scale.value;
}

inline float sigmoid(float x) { return 1.0f / (1.0f + exp_approx(-x)); }

struct Float32Gates {
    const float* data;
    int64_t row_stride;
    float operator()(int64_t row, int64_t column) const { return data[row * row_stride + column]; }
};

struct BFloat16Gates {
    const uint16_t* data;
    int64_t row_stride;
    float operator()(int64_t row, int64_t column) const { return bf16_to_float(data[row * row_stride + column]); }
};

// The inference engine's pre-activations as two terms: the step's recurrent product and the gate
// inputs it adds (G_t, the bias in it), each float32 or bfloat16 (T), added in float32 as they are
// read, so that the product runs alone (with the sum fused into it, oneDNN's product ran markedly
// slower) and, in bfloat16, the sum is never rounded (elmokit.inference.engine.recurrent_gates).
template <typename T>
struct SummedGates {
    const T* product;
    int64_t product_stride;
    const T* addend;
    int64_t addend_stride;
    float operator()(int64_t row, int64_t column) const {
        return to_float(product[row * product_stride + column]) + to_float(addend[row * addend_stride + column]);
    }
};

// One int8 product before its remaining scales: int32 sums times the weight's scales per output
// channel (kIntegerSums), or a float32 product already times them (oneDNN's quantized linear).
template <bool kIntegerSums>
inline float weight_scaled(const void* product, const float* weight_scale, int64_t at, int64_t column) {
    if constexpr (kIntegerSums)
        return float(static_cast<const int32_t*>(product)[at]) * weight_scale[column];
    else
        return static_cast<const float*>(product)[at];
}

// bias + input * input_row_scale + recurrent * recurrent_row_scale, each product `weight_scaled`
// first: elmokit.model.int8.Int8Linear's order of operations (`finish` or its call, then `add`).
template <bool kIntegerInput, bool kIntegerRecurrent>
struct Int8Gates {
    const void* input;
    const float* input_row_scale;
    const float* input_weight_scale;
    const float* bias;
    const void* recurrent;
    const float* recurrent_row_scale;
    const float* recurrent_weight_scale;
    int64_t width;
    float operator()(int64_t row, int64_t column) const {
        const int64_t at = row * width + column;
        const float gate = bias[column] + weight_scaled<kIntegerInput>(input, input_weight_scale, at, column)
                                              * input_row_scale[row];
        return gate + weight_scaled<kIntegerRecurrent>(recurrent, recurrent_weight_scale, at, column)
                          * recurrent_row_scale[row];
    }
};

template <typename Output>
inline void store(Output* out, int64_t at, float value);
template <>
inline void store<float>(float* out, int64_t at, float value) { out[at] = value; }
template <>
inline void store<uint16_t>(uint16_t* out, int64_t at, float value) { out[at] = float_to_bf16(value); }

// The cell clip: values kept within [-clip, clip]; a clip of 0 keeps every value.
struct Clip {
    float low, high;
    explicit Clip(float clip)
        : low(clip > 0.0f ? -clip : -__builtin_inff()), high(clip > 0.0f ? clip : __builtin_inff()) {}
    float operator()(float value) const { return value < low ? low : (value > high ? high : value); }
};

// body(row, first, last) for every block of kBlock columns [first, last) of each of `rows` rows of
// `width` columns, the blocks shared among `threads` OpenMP threads (one where the work is too small
// to pay for waking them).
template <typename Body>
inline void for_each_block(int64_t rows, int64_t width, int threads, const Body& body) {
    const int64_t blocks = (width + kBlock - 1) / kBlock;
    const int64_t items = rows * blocks;
    const int use = items * kBlock >= 16384 ? threads : 1;
#pragma omp parallel for num_threads(use) schedule(static)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t first = (item % blocks) * kBlock;
        body(item / blocks, first, first + kBlock < width ? first + kBlock : width);
    }
}

template <typename Gates, typename Output>
void cell(const Gates gates, float* __restrict cell_state, Output* __restrict output,
          int64_t rows, int64_t cell_dim, float cell_clip, int threads) {
    const Clip clip(cell_clip);
    for_each_block(rows, cell_dim, threads, [&](int64_t row, int64_t first, int64_t last) {
        float* __restrict state = cell_state + row * cell_dim;
        Output* __restrict out = output + row * cell_dim;
        const Gates local = gates;  // its pointers in registers: the stores below cannot change them
#pragma omp simd
        for (int64_t c = first; c < last; ++c) {
            const float input_gate = sigmoid(local(row, c));
            const float forget_gate = sigmoid(local(row, cell_dim + c));
            const float output_gate = sigmoid(local(row, 2 * cell_dim + c));
            const float candidate = sigmoid(local(row, 3 * cell_dim + c)) * 2.0f - 1.0f;
            const float next = clip(forget_gate * state[c] + input_gate * candidate);
            state[c] = next;
            store(out, c, output_gate * (sigmoid(2.0f * next) * 2.0f - 1.0f));
        }
    });
}

template <typename Gates>
void cell_to(const Gates gates, float* cell_state, void* output, int output_bf16, int64_t rows,
             int64_t cell_dim, float cell_clip, int threads) {
    if (output_bf16)
        cell(gates, cell_state, static_cast<uint16_t*>(output), rows, cell_dim, cell_clip, threads);
    else
        cell(gates, cell_state, static_cast<float*>(output), rows, cell_dim, cell_clip, threads);
}

template <bool kIntegerInput>
void int8_cell(const void* input, const float* input_row_scale, const float* input_weight_scale, const float* bias,
               const void* recurrent, const float* recurrent_row_scale, const float* recurrent_weight_scale,
               float* cell_state, void* output, int output_bf16, int64_t rows, int64_t cell_dim, float cell_clip,
               int threads) {
    if (recurrent_weight_scale)
        cell_to(Int8Gates<kIntegerInput, true>{input, input_row_scale, input_weight_scale, bias, recurrent,
                                               recurrent_row_scale, recurrent_weight_scale, 4 * cell_dim},
                cell_state, output, output_bf16, rows, cell_dim, cell_clip, threads);
    else
        cell_to(Int8Gates<kIntegerInput, false>{input, input_row_scale, input_weight_scale, bias, recurrent,
                                                recurrent_row_scale, nullptr, 4 * cell_dim},
                cell_state, output, output_bf16, rows, cell_dim, cell_clip, threads);
}

// Training's forward pass reads a step's pre-activations (i, f, o, j) as one float32 sum (the
// products in float32, G_t + h_{t-1} W_rec^T: Float32Gates) or, with bfloat16 products, as its three
// terms, bias + G_t + the recurrent product, added in float32 in that order (Bfloat16Terms).
struct Bfloat16Terms {
    const float* bias;
    const uint16_t* inputs;
    int64_t input_stride;
    const uint16_t* recurrent;
    int64_t recurrent_stride;
    float operator()(int64_t row, int64_t column) const {
        return (bias[column] + bf16_to_float(inputs[row * input_stride + column]))
               + bf16_to_float(recurrent[row * recurrent_stride + column]);
    }
};

// Training's step, forward: from the pre-activations (i, f, o, j) of a step (the candidate not
// doubled), the activated gates (σ(i), σ(f), σ(o), tanh j), c_t and tanh(c_t) in float32, and m_t in
// float32 or bfloat16 (then only the projection's operand), each written for the backward pass
// (elmokit.training.recurrence.forward_cell's buffers).
template <typename Gates, typename Output>
void train_forward(const Gates gates, float* __restrict acts, const float* __restrict cell_prev,
                   float* __restrict cell_next, float* __restrict tanh_cell, Output* __restrict cell_output,
                   int64_t rows, int64_t cell_dim, float cell_clip, int threads) {
    const Clip clip(cell_clip);
    for_each_block(rows, cell_dim, threads, [&](int64_t row, int64_t first, int64_t last) {
        const Gates gate = gates;  // its pointers in registers: the stores below cannot change them
        float* __restrict act = acts + row * 4 * cell_dim;
        const float* __restrict previous = cell_prev + row * cell_dim;  // restrict here: see train_backward
        float* __restrict next = cell_next + row * cell_dim;
        float* __restrict tanh_row = tanh_cell + row * cell_dim;
        Output* __restrict output = cell_output + row * cell_dim;
#pragma omp simd
        for (int64_t c = first; c < last; ++c) {
            const float input_gate = sigmoid(gate(row, c));
            const float forget_gate = sigmoid(gate(row, cell_dim + c));
            const float output_gate = sigmoid(gate(row, 2 * cell_dim + c));
            const float candidate = sigmoid(2.0f * gate(row, 3 * cell_dim + c)) * 2.0f - 1.0f;
            act[c] = input_gate;
            act[cell_dim + c] = forget_gate;
            act[2 * cell_dim + c] = output_gate;
            act[3 * cell_dim + c] = candidate;
            const float c_t = clip(forget_gate * previous[c] + input_gate * candidate);
            next[c] = c_t;
            const float tanh_next = sigmoid(2.0f * c_t) * 2.0f - 1.0f;
            tanh_row[c] = tanh_next;
            store(output, c, output_gate * tanh_next);
        }
    });
}

template <typename Gates>
void train_forward_to(const Gates gates, float* acts, const float* cell_prev, float* cell_next, float* tanh_cell,
                      void* cell_output, int output_bf16, int64_t rows, int64_t cell_dim, float cell_clip,
                      int threads) {
    if (output_bf16)
        train_forward(gates, acts, cell_prev, cell_next, tanh_cell, static_cast<uint16_t*>(cell_output), rows,
                      cell_dim, cell_clip, threads);
    else
        train_forward(gates, acts, cell_prev, cell_next, tanh_cell, static_cast<float*>(cell_output), rows,
                      cell_dim, cell_clip, threads);
}

constexpr int64_t kColumns = 64;  // columns of one work item of the backward pass

// Training's step, backward: from dL/dm_t (grad_m, float32 or the bfloat16 product) and the cell
// gradient carried from step t+1 (cell_grad), the gradients of the four pre-activations (gate_grads
// (rows, 4, C), float32 or bfloat16: the next products' operand), their sum over the rows added
// into bias_grad (4 C, float32, from the float32 gradients), and dL/dc_{t-1} (written over
// cell_grad), with the forward pass's acts, c_{t-1}, c_t (where it was clipped, the gradient
// stops, as torch.clamp's) and tanh(c_t):
//     dc = (cell_grad + grad_m o (1 - tanh(c_t)^2)) [|c_t| < clip]
//     di = dc (i - i^2) j   df = dc (f - f^2) c_{t-1}   do = grad_m (o - o^2) tanh(c_t)   dj = dc i (1 - j^2)
//     dc_{t-1} = dc f
// The threads take blocks of kColumns columns, each over every row: the bias' sums need no merging.
template <typename GradM, typename GateGrad>
void train_backward(const GradM* grad_m, float* cell_grad, const float* acts, const float* cell_prev,
                    const float* cell_next, const float* tanh_cell, GateGrad* gate_grads, float* bias_grad,
                    int64_t rows, int64_t cell_dim, float cell_clip, int threads) {
    const int64_t blocks = (cell_dim + kColumns - 1) / kColumns;
    const int use = rows * cell_dim >= 16384 ? threads : 1;
#pragma omp parallel for num_threads(use) schedule(static)
    for (int64_t block = 0; block < blocks; ++block) {
        const int64_t first = block * kColumns, last = first + kColumns < cell_dim ? first + kColumns : cell_dim;
        float* __restrict bias = bias_grad;
        for (int64_t row = 0; row < rows; ++row) {
            // the row's pointers restrict-qualified (a lambda's captures are not): the loop vectorizes
            const float* __restrict act = acts + row * 4 * cell_dim;
            GateGrad* __restrict grads = gate_grads + row * 4 * cell_dim;
            const GradM* __restrict dm_row = grad_m + row * cell_dim;
            float* __restrict carried = cell_grad + row * cell_dim;
            const float* __restrict previous = cell_prev + row * cell_dim;
            const float* __restrict next = cell_next + row * cell_dim;
            const float* __restrict tanh_row = tanh_cell + row * cell_dim;
            const float limit = cell_clip;
#pragma omp simd
            for (int64_t c = first; c < last; ++c) {
                const float input_gate = act[c], forget_gate = act[cell_dim + c];
                const float output_gate = act[2 * cell_dim + c], candidate = act[3 * cell_dim + c];
                const float tanh_next = tanh_row[c], dm = to_float(dm_row[c]);
                float dc = carried[c] + dm * (output_gate - output_gate * (tanh_next * tanh_next));
                if (limit > 0.0f)
                    dc = (next[c] < limit && next[c] > -limit) ? dc : 0.0f;
                const float input_grad = (input_gate - input_gate * input_gate) * candidate * dc;
                const float forget_grad = (forget_gate - forget_gate * forget_gate) * previous[c] * dc;
                const float output_grad = (output_gate - output_gate * output_gate) * tanh_next * dm;
                const float candidate_grad = (input_gate - input_gate * (candidate * candidate)) * dc;
                store(grads, c, input_grad);
                store(grads, cell_dim + c, forget_grad);
                store(grads, 2 * cell_dim + c, output_grad);
                store(grads, 3 * cell_dim + c, candidate_grad);
                bias[c] += input_grad;
                bias[cell_dim + c] += forget_grad;
                bias[2 * cell_dim + c] += output_grad;
                bias[3 * cell_dim + c] += candidate_grad;
                carried[c] = dc * forget_gate;
            }
        }
    }
}

template <typename GradM>
void train_backward_to(const GradM* grad_m, float* cell_grad, const float* acts, const float* cell_prev,
                       const float* cell_next, const float* tanh_cell, void* gate_grads, int grads_bf16,
                       float* bias_grad, int64_t rows, int64_t cell_dim, float cell_clip, int threads) {
    if (grads_bf16)
        train_backward(grad_m, cell_grad, acts, cell_prev, cell_next, tanh_cell, static_cast<uint16_t*>(gate_grads),
                       bias_grad, rows, cell_dim, cell_clip, threads);
    else
        train_backward(grad_m, cell_grad, acts, cell_prev, cell_next, tanh_cell, static_cast<float*>(gate_grads),
                       bias_grad, rows, cell_dim, cell_clip, threads);
}

// The training softmax's elementwise work on a block of rows (elmokit.training.softmax, full form):
// from the logits (rows, V), float32, or bfloat16 products to which the float32 bias is added here,
// each row's nll = log sum_k exp(l_k - max) + max - l_target and its gradient
// d nll / d logits = softmax - onehot(target), written as float32 (over the logits: the same buffer)
// or bfloat16 (the next products' operand), and the bias' gradient, the sum of the rows' float32
// gradients, added into bias_grad. Three passes over a row (its max, its sum, the gradient), each
// from cache; the threads take rows, each summing its own columns, added up at the end.
template <typename In, typename Out, bool kBias>
void softmax_rows(const In* logits, const float* bias, const int64_t* targets, Out* grad, float* bias_grad,
                  float* nll, int64_t rows, int64_t width, int threads) {
    const int use = rows * width >= 65536 ? threads : 1;
    float* partials = new float[int64_t(use) * width]();
#pragma omp parallel num_threads(use)
    {
        int thread = 0, count = 1;
#ifdef _OPENMP
        thread = omp_get_thread_num();
        count = omp_get_num_threads();
#endif
        float* __restrict partial = partials + int64_t(thread) * width;
        for (int64_t row = thread; row < rows; row += count) {
            const In* in = logits + row * width;  // float32: `out` is `in` (written over it)
            Out* out = grad + row * width;
            float top = -__builtin_inff();
#pragma omp simd reduction(max : top)
            for (int64_t k = 0; k < width; ++k) {
                const float logit = to_float(in[k]) + (kBias ? bias[k] : 0.0f);
                top = logit > top ? logit : top;
            }
            float total = 0.0f;
#pragma omp simd reduction(+ : total)
            for (int64_t k = 0; k < width; ++k) total += exp_approx(to_float(in[k]) + (kBias ? bias[k] : 0.0f) - top);
            const int64_t target = targets[row];
            const float target_logit = to_float(in[target]) + (kBias ? bias[target] : 0.0f);
            nll[row] = std::log(total) + top - target_logit;
            const float inverse = 1.0f / total;
#pragma omp simd
            for (int64_t k = 0; k < width; ++k) {
                const float probability = exp_approx(to_float(in[k]) + (kBias ? bias[k] : 0.0f) - top) * inverse;
                const float gradient = k == target ? probability - 1.0f : probability;
                store(out, k, gradient);
                partial[k] += gradient;
            }
        }
    }
    for (int thread = 0; thread < use; ++thread)
        for (int64_t k = 0; k < width; ++k) bias_grad[k] += partials[int64_t(thread) * width + k];
    delete[] partials;
}

// The token encoder's highway layer after its product (elmokit.model.highway.highway_gate):
//     x <- x + σ(carry) * (relu(transform) - x)
// from the product [transform | carry] (rows, 2 dim) in float32 or bfloat16 (T) and x (rows, dim)
// float32, into `out` (float32) and, with kNarrow, also rounded to bfloat16 into `narrow` (the next
// product's operand, so that no cast follows). Eager torch makes four passes for this, and with
// bfloat16 products two casts.
template <typename T, bool kNarrow>
void highway(const T* product, const float* x, float* out, uint16_t* narrow, int64_t rows, int64_t dim,
             int threads) {
    for_each_block(rows, dim, threads, [&](int64_t row, int64_t first, int64_t last) {
        const T* __restrict terms = product + row * 2 * dim;
        const float* __restrict previous = x + row * dim;
        float* __restrict next = out + row * dim;
        uint16_t* __restrict rounded = kNarrow ? narrow + row * dim : nullptr;
#pragma omp simd
        for (int64_t c = first; c < last; ++c) {
            const float transform = to_float(terms[c]);
            const float relu = transform < 0.0f ? 0.0f : transform;  // NaN stays NaN, as torch.relu
            const float value = previous[c] + sigmoid(to_float(terms[dim + c])) * (relu - previous[c]);
            next[c] = value;
            if constexpr (kNarrow) rounded[c] = float_to_bf16(value);
        }
    });
}

// The char CNN's max over windows (elmokit.model.encoder.window_max): (tokens, windows, width) window
// products, float32 or bfloat16 (T), each token's rows contiguous -> (tokens, width) in T; NaN where
// any window holds NaN, as torch.amax. One pass over the products, a block of columns at a time in
// float32 registers (exact: every value is one of the products).
template <typename T>
void window_max(const T* products, T* out, int64_t tokens, int64_t windows, int64_t width, int threads) {
    for_each_block(tokens, width, threads, [&](int64_t token, int64_t first, int64_t last) {
        const T* __restrict rows = products + token * windows * width;
        float best[kBlock];
        int nan[kBlock];
        const int64_t count = last - first;
#pragma omp simd
        for (int64_t c = 0; c < count; ++c) {
            best[c] = to_float(rows[first + c]);
            nan[c] = best[c] != best[c];
        }
        for (int64_t window = 1; window < windows; ++window) {
            const T* __restrict row = rows + window * width + first;
#pragma omp simd
            for (int64_t c = 0; c < count; ++c) {
                const float value = to_float(row[c]);
                best[c] = value > best[c] ? value : best[c];
                nan[c] |= value != value;
            }
        }
        T* __restrict result = out + token * width + first;
        for (int64_t c = 0; c < count; ++c) store(result, c, nan[c] ? __builtin_nanf("") : best[c]);
    });
}

}  // namespace

extern "C" {

int elmokit_fused_cell_version() { return 8; }

// gates (rows, 4 cell_dim) with `row_stride` elements between rows, float32 (gates_bf16 0) or bfloat16;
// `addend` null, or a second term of the gates' dtype and shape (`addend_stride` between its rows),
// added to them in float32 (SummedGates).
void elmokit_lstm_cell(const void* gates, int gates_bf16, int64_t row_stride, const void* addend,
                       int64_t addend_stride, float* cell_state, void* output, int output_bf16, int64_t rows,
                       int64_t cell_dim, float cell_clip, int threads) {
    if (addend && gates_bf16)
        cell_to(SummedGates<uint16_t>{static_cast<const uint16_t*>(gates), row_stride,
                                      static_cast<const uint16_t*>(addend), addend_stride},
                cell_state, output, output_bf16, rows, cell_dim, cell_clip, threads);
    else if (addend)
        cell_to(SummedGates<float>{static_cast<const float*>(gates), row_stride, static_cast<const float*>(addend),
                                   addend_stride},
                cell_state, output, output_bf16, rows, cell_dim, cell_clip, threads);
    else if (gates_bf16)
        cell_to(BFloat16Gates{static_cast<const uint16_t*>(gates), row_stride}, cell_state, output,
                output_bf16, rows, cell_dim, cell_clip, threads);
    else
        cell_to(Float32Gates{static_cast<const float*>(gates), row_stride}, cell_state, output,
                output_bf16, rows, cell_dim, cell_clip, threads);
}

// int8 products' gates: input and recurrent (rows, 4 cell_dim) contiguous, each int32 sums with its
// weight scales (4 cell_dim), or float32 already times them (its weight scale null); row scales (rows).
void elmokit_lstm_cell_int8(const void* input, const float* input_row_scale, const float* input_weight_scale,
                            const float* bias, const void* recurrent, const float* recurrent_row_scale,
                            const float* recurrent_weight_scale, float* cell_state, void* output, int output_bf16,
                            int64_t rows, int64_t cell_dim, float cell_clip, int threads) {
    if (input_weight_scale)
        int8_cell<true>(input, input_row_scale, input_weight_scale, bias, recurrent, recurrent_row_scale,
                        recurrent_weight_scale, cell_state, output, output_bf16, rows, cell_dim, cell_clip, threads);
    else
        int8_cell<false>(input, input_row_scale, input_weight_scale, bias, recurrent, recurrent_row_scale,
                         recurrent_weight_scale, cell_state, output, output_bf16, rows, cell_dim, cell_clip, threads);
}

// The highway layer: product (rows, 2 dim) float32 or bfloat16 (product_bf16), x and out (rows, dim)
// float32, narrow (rows, dim) bfloat16 (bfloat16 products only) or null; all contiguous.
void elmokit_highway(const void* product, int product_bf16, const float* x, float* out, uint16_t* narrow,
                     int64_t rows, int64_t dim, int threads) {
    if (product_bf16 && narrow)
        highway<uint16_t, true>(static_cast<const uint16_t*>(product), x, out, narrow, rows, dim, threads);
    else if (product_bf16)
        highway<uint16_t, false>(static_cast<const uint16_t*>(product), x, out, nullptr, rows, dim, threads);
    else
        highway<float, false>(static_cast<const float*>(product), x, out, nullptr, rows, dim, threads);
}

// The char CNN's max over windows: products (tokens, windows, width) and out (tokens, width), contiguous, both
// float32 (bf16 0) or bfloat16.
void elmokit_window_max(const void* products, int bf16, void* out, int64_t tokens, int64_t windows, int64_t width,
                        int threads) {
    if (bf16)
        window_max(static_cast<const uint16_t*>(products), static_cast<uint16_t*>(out), tokens, windows, width,
                   threads);
    else
        window_max(static_cast<const float*>(products), static_cast<float*>(out), tokens, windows, width, threads);
}

// Training (elmokit.training.recurrence): one direction's step, each tensor (rows, .) contiguous but
// the gates and the recurrent product, whose rows are their stride apart. gates_bf16 0: gates the
// float32 pre-activations (bias and recurrent unused); 1: the bfloat16 G_t, added to the float32 bias
// (4 cell_dim) and then to the bfloat16 `recurrent` product. m_t into cell_output, float32 or bfloat16.
void elmokit_lstm_train_forward(const void* gates, int gates_bf16, int64_t gate_stride, const float* bias,
                                const uint16_t* recurrent, int64_t recurrent_stride, float* acts,
                                const float* cell_prev, float* cell_next, float* tanh_cell, void* cell_output,
                                int output_bf16, int64_t rows, int64_t cell_dim, float cell_clip, int threads) {
    if (gates_bf16)
        train_forward_to(Bfloat16Terms{bias, static_cast<const uint16_t*>(gates), gate_stride, recurrent,
                                       recurrent_stride},
                         acts, cell_prev, cell_next, tanh_cell, cell_output, output_bf16, rows, cell_dim, cell_clip,
                         threads);
    else
        train_forward_to(Float32Gates{static_cast<const float*>(gates), gate_stride}, acts, cell_prev, cell_next,
                         tanh_cell, cell_output, output_bf16, rows, cell_dim, cell_clip, threads);
}

// grad_m float32 or bfloat16 (grad_m_bf16), gate_grads float32 or bfloat16 (grads_bf16); bias_grad
// (4 cell_dim) float32, added into.
void elmokit_lstm_train_backward(const void* grad_m, int grad_m_bf16, float* cell_grad, const float* acts,
                                 const float* cell_prev, const float* cell_next, const float* tanh_cell,
                                 void* gate_grads, int grads_bf16, float* bias_grad, int64_t rows, int64_t cell_dim,
                                 float cell_clip, int threads) {
    if (grad_m_bf16)
        train_backward_to(static_cast<const uint16_t*>(grad_m), cell_grad, acts, cell_prev, cell_next, tanh_cell,
                          gate_grads, grads_bf16, bias_grad, rows, cell_dim, cell_clip, threads);
    else
        train_backward_to(static_cast<const float*>(grad_m), cell_grad, acts, cell_prev, cell_next, tanh_cell,
                          gate_grads, grads_bf16, bias_grad, rows, cell_dim, cell_clip, threads);
}

// The training softmax's rows: logits (rows, width) float32 (logits_bf16 0: the gradient written over
// them, grad the same pointer) or bfloat16 (its gradient into grad, bfloat16), all contiguous.
void elmokit_softmax_rows(const void* logits, int logits_bf16, const float* bias, const int64_t* targets, void* grad,
                          float* bias_grad, float* nll, int64_t rows, int64_t width, int threads) {
    const auto run = [&](auto in, auto out) {  // the bias a template argument: each loop vectorized without a branch
        if (bias)
            softmax_rows<std::remove_cv_t<std::remove_pointer_t<decltype(in)>>,
                         std::remove_pointer_t<decltype(out)>, true>(in, bias, targets, out, bias_grad, nll, rows,
                                                                     width, threads);
        else
            softmax_rows<std::remove_cv_t<std::remove_pointer_t<decltype(in)>>,
                         std::remove_pointer_t<decltype(out)>, false>(in, bias, targets, out, bias_grad, nll, rows,
                                                                      width, threads);
    };
    if (logits_bf16)
        run(static_cast<const uint16_t*>(logits), static_cast<uint16_t*>(grad));
    else
        run(static_cast<const float*>(logits), static_cast<float*>(grad));
}

}  // extern "C"
