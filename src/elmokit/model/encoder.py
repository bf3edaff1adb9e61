"""The token encoder (bilm-tf's): char ids -> char embedding -> convolutions of several widths,
max-pooled -> highway -> projection. Context-free: one vector a token, any word in any language.

Shape notation: N tokens, W 50 char ids a token, E char embedding dim, F total CNN filters,
P projection dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from elmokit.devices import without_autocast
from elmokit.model import fused_cell
from elmokit.model.highway import highway_gate
from elmokit.model.int8 import bf16_copies, module_linear, module_weights, narrows
from elmokit.kernels import linear, matmul
from elmokit.model.chars import N_CHAR_IDS
from elmokit.model.config import ElmoConfig

_ACTIVATIONS = {"relu": torch.relu, "tanh": torch.tanh}


# ---------------------------------------------------------------------------------------------
# Token encoder: char embedding -> convolutions with max-pool -> highway -> projection
# ---------------------------------------------------------------------------------------------
class CharCNN(nn.Module):
    """Character embedding, one "valid" convolution per filter bank, max over positions.

    Input (N, W) char ids, output (N, F) pooled features after the activation.
    """

    def __init__(self, embedding_dim: int, filters: tuple[tuple[int, int], ...], activation: str):
        super().__init__()
        self.char_embedding = nn.Embedding(N_CHAR_IDS, embedding_dim, padding_idx=0)
        self.convolutions = nn.ModuleList(
            nn.Conv1d(embedding_dim, count, width) for width, count in filters
        )
        self.activation = _ACTIVATIONS[activation]

    CHUNK = 64  # tokens a pass without gradients (bench/results/char-cnn.md times 16 to 128)

    def forward(self, char_ids: torch.Tensor) -> torch.Tensor:
        weights = [self.char_embedding.weight, *(conv.weight for conv in self.convolutions)]
        if torch.is_grad_enabled() and any(weight.requires_grad for weight in weights):  # training
            pooled = CharConvMaxPool.apply(char_ids, *weights)
        else:
            if narrows(self):  # dtype="int8": the window products in bfloat16 (float32 from the max on)
                weights = bf16_copies(self, *weights)
            chars = F.embedding(char_ids, weights[0])  # (N, W, E)
            kernels = flat_kernels(weights[1:])
            pooled = torch.cat([torch.cat([window_max(products) for products in window_products(chunk, kernels)], -1)
                                for chunk in chars.split(self.CHUNK)])  # (N, F)
        bias = torch.cat([conv.bias for conv in self.convolutions])  # max(x + b) = max(x) + b
        dtype = torch.promote_types(pooled.dtype, torch.float32)  # bfloat16 weights: float32 from here on
        return self.activation(pooled.to(dtype) + bias.to(dtype))  # (N, F)


def flat_kernels(kernels) -> list[torch.Tensor]:
    """Convolution kernels (n_i, E, w) as product weights (n_i, w*E), in window order."""
    return [kernel.transpose(1, 2).flatten(1) for kernel in kernels]


def window_products(chars: torch.Tensor, kernels: list[torch.Tensor]):
    """Each convolution over chars (n, W, E) as one product over all its windows (through oneDNN,
    `elmokit.kernels`): yields (n, W - w + 1, n_i) per kernel (n_i, w*E) of `flat_kernels`. Callers
    pass a few tokens at a time, so the products stay in cache."""
    n_tokens, n_chars, dim = chars.shape
    for kernel in kernels:
        width = kernel.shape[1] // dim
        windows = chars.unfold(1, width, 1).transpose(2, 3).reshape(-1, kernel.shape[1])  # (n*(W-w+1), w*E)
        yield linear(windows, kernel).view(n_tokens, n_chars - width + 1, kernel.shape[0])


NARROW_MAX_FILTERS = 64  # bfloat16 window products of fewer filters are widened for their max (`window_max`)


def window_max(products: torch.Tensor) -> torch.Tensor:
    """The max over the windows of (n, L, f) window products -> (n, f), in their dtype. torch's
    bfloat16 max over the middle axis is far slower than float32's where f is 32 (the original
    char CNN's two narrowest convolutions), not from 64 filters (bench/results/char-cnn.md); so a
    narrow one is widened first, with the same values (widening is exact, and so is narrowing its
    max back). Without gradients on the CPU, one compiled pass (`fused_cell.window_max_`) instead."""
    if not torch.is_grad_enabled():
        pooled = fused_cell.window_max_(products)
        if pooled is not None:
            return pooled
    if products.dtype == torch.bfloat16 and products.shape[-1] < NARROW_MAX_FILTERS:
        return products.float().amax(dim=1).to(products.dtype)
    return products.amax(dim=1)


def max_over_windows(products: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.max(products, dim=1) of (n, L, f) window products: the values (n, f) and the first
    window holding each (n, f), faster on the CPU (torch's max-with-indices kernel is not
    vectorized; amax is; bench/results/train.md times both): amax, then sign(p - max) + 1, which for finite values is 1 exactly where
    p equals the max and 0 elsewhere, times L - position, whose amax marks the first such window.
    A column holding +inf finds it too (inf - inf is NaN, whose sign torch gives as 0: + 1 is 1);
    a column holding NaN gets a valid window (its value is NaN whichever window carries it)."""
    values = products.amax(dim=1)  # (n, f)
    n_windows = products.shape[1]
    descending = torch.arange(n_windows, 0, -1, dtype=products.dtype, device=products.device).view(1, -1, 1)
    marks = torch.sub(products, values.unsqueeze(1)).sign_().add_(1).mul_(descending)  # (n, L, f)
    first = (n_windows - marks.amax(dim=1)).long().clamp_(0, n_windows - 1)  # NaN products: a valid window
    return values, first


class CharConvMaxPool(torch.autograd.Function):
    """Char embedding, the convolutions (no bias) and the max over positions, for training.

    apply(char_ids (N, W), embedding (V, E), *kernels (n_i, E, w_i)) -> pooled (N, F)

    The max passes its gradient to one window per token and filter, and a window's chars come
    from a table of only V = 262 rows. So with g (N, n_i) the gradient of a filter bank and
    A_k[v, f] = sum over tokens n whose char k of the chosen window of filter f is v of g[n, f]
    (one scatter-add of N n_i values per k), both gradients are small products:

        dkernel[f, :, k] = sum_v A_k[v, f] embedding[v]      dembedding[v] = sum_{f,k} A_k[v, f] kernel[f, :, k]

    instead of a dense convolution backward over all W - w + 1 windows (N W n_i w E multiply-adds
    twice). Row 0 (no token) gets no gradient, as `nn.Embedding(padding_idx=0)`. Tied windows
    of one token (runs of in-word padding) have equal chars, so which one carries the gradient
    changes nothing.
    """

    CHUNK = 64  # tokens a pass: their window products stay in cache

    @staticmethod
    def forward(ctx, char_ids, embedding, *kernels):
        with without_autocast(char_ids.device.type):  # the weights' dtype, also under autocast
            pooled, windows = CharConvMaxPool._pool(char_ids, embedding, kernels)
        ctx.save_for_backward(char_ids, embedding, *kernels, *windows)
        return pooled

    @staticmethod
    def _pool(char_ids, embedding, kernels) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The pooled features (N, F) and each filter's chosen window (N, n_i) per kernel."""
        chars = F.embedding(char_ids, embedding)  # (N, W, E)
        flat = flat_kernels(kernels)
        chunks = [[max_over_windows(products) for products in window_products(chunk, flat)]
                  for chunk in chars.split(CharConvMaxPool.CHUNK)]  # per chunk, per kernel: (values, windows)
        pooled = torch.cat([torch.cat([values for values, _ in chunk], -1) for chunk in chunks])
        windows = [torch.cat([chunk[index][1] for chunk in chunks]) for index in range(len(kernels))]
        return pooled, windows

    @staticmethod
    def backward(ctx, grad_pooled):
        with without_autocast(grad_pooled.device.type):
            return CharConvMaxPool._gradients(ctx, grad_pooled)

    @staticmethod
    def _gradients(ctx, grad_pooled):
        char_ids, embedding, *rest = ctx.saved_tensors
        wants_embedding, wants_kernels = ctx.needs_input_grad[1], ctx.needs_input_grad[2:]
        kernels, windows = rest[:len(rest) // 2], rest[len(rest) // 2:]
        dtype = torch.promote_types(embedding.dtype, torch.float32)  # bfloat16 weights: sums in float32
        table = embedding.to(dtype)
        grad_embedding = torch.zeros_like(table)
        grad_kernels = []
        grads = grad_pooled.to(dtype).split([kernel.shape[0] for kernel in kernels], -1)
        for index, (kernel, chosen, grad) in enumerate(zip(kernels, windows, grads)):
            count, _, width = kernel.shape
            offsets = torch.arange(width, device=chosen.device)
            chars = char_ids.gather(1, (chosen.unsqueeze(2) + offsets).flatten(1))  # (N, n_i * w): ids of each char
            sums = torch.zeros(len(table), count * width, device=table.device, dtype=table.dtype)
            sums.scatter_add_(0, chars, grad.repeat_interleave(width, dim=1))  # (V, n_i * w): the A_k side by side
            # dkernel[f, :, k] = sum_v A_k[v, f] embedding[v]; dembedding[v] = sum_{f,k} A_k[v, f] kernel[f, :, k]
            grad_kernels.append(matmul(sums.mT, table).reshape(count, width, -1).transpose(1, 2).to(kernel.dtype)
                                if wants_kernels[index] else None)  # (n_i, E, w)
            if wants_embedding:
                grad_embedding += matmul(sums, kernel.to(dtype).transpose(1, 2).reshape(count * width, -1))
        grad_embedding[0] = 0
        return None, grad_embedding.to(embedding.dtype) if wants_embedding else None, *grad_kernels


class Highway(nn.Module):
    """Highway layers: with carry gate c = sigmoid(x W_c + b_c) and transform t = relu(x W_t + b_t),
    x <- c * t + (1 - c) * x, computed as x + c * (t - x). One Linear per layer computes [transform | carry]."""

    def __init__(self, dim: int, n_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, 2 * dim) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.device.type != "cpu" or not fused_cell.available():
            for layer in self.layers:
                x = highway_gate(module_linear(layer, x), x)
            return x
        operand = x  # inference on the CPU: x in the products' dtype, as the compiled pass writes it
        for layer in self.layers:
            weight, bias = module_weights(layer)
            product = linear(operand.to(weight.dtype), weight, bias)  # (N, 2F) in the weights' dtype
            gated = fused_cell.highway_(product, x)  # one pass (elmokit.model.fused_cell), no casts
            if gated is None:  # tensors the pass does not take
                gated = (highway_gate(product.to(x.dtype), x),) * 2
            x, operand = gated
        return x


class TokenEncoder(nn.Module):
    """The context-free token representation: CharCNN -> Highway -> projection to P.

    Input (N, W) char ids of real tokens, output (N, P).
    """

    def __init__(self, config: ElmoConfig):
        super().__init__()
        cnn = config.char_cnn
        self.char_cnn = CharCNN(cnn.embedding_dim, cnn.filters, cnn.activation)
        self.highway = Highway(cnn.n_filters, cnn.n_highway)
        self.projection = nn.Linear(cnn.n_filters, config.lstm.projection_dim)

    def forward(self, char_ids: torch.Tensor) -> torch.Tensor:
        features = self.highway(self.char_cnn(char_ids))  # (N, F)
        return module_linear(self.projection, features)  # (N, P)

    def narrowed(self) -> list[nn.Module]:
        """What `dtype="int8"` runs in bfloat16 (`elmokit.model.int8.narrows`): the char CNN's window products
        and the highway's and projection's Linears (`elmokit.model.int8.module_linear`)."""
        return [self.char_cnn, *self.highway.layers, self.projection]
