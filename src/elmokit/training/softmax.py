"""The LM's softmax loss in one pass: logits, log-sum-exp and every gradient, a block of rows at a
time, with the (N, V) logits never held whole.

`F.cross_entropy(hidden @ W^T + b, targets)` keeps the (N, V) logits and their log-softmax for
the backward pass, then zero-fills and scatters an (N, V) gradient and runs a log-softmax
backward: four more passes over 25-250 MB a direction for the biLM's 640 targets a window and a
10k-100k softmax. Here each block of rows (all of them when the logits fit `LOGIT_BUDGET`)
computes its logits, turns them into probabilities (the full form by torch's softmax, a row at a
time in cache; the sampled form in place), subtracts one at the target (d nll / d logits =
softmax - onehot) and accumulates the gradients of the hidden states, the weight and the bias
right away; the backward pass only scales them by the incoming gradient. On the CPU the full form's
work between the products (each row's max, sum, nll and softmax - onehot, the bias gradient) is
one compiled pass (`elmokit.model.fused_cell.softmax_rows_`, self-checked against torch's softmax
when loaded), the eager code below where it does not run.

Two forms of the same loss, `nll = logsumexp(candidates) - target logit`:
    full       candidates = every row of W; the target is a column (`targets`)
    sampled    candidates = the sampled rows of W (bias already log-Q corrected) plus one
               extra column per row, the true logit (`true_logits`, differentiable); `hits`
               marks the candidate column equal to the target (-1: none), which is removed

Without gradients (validation, `elmo perplexity`) the full form is `full_softmax_nll`: the
log-sum-exp a vocabulary slice at a time (online), each slice's logits in cache.

Shape notation: N rows (targets), P hidden dim, K candidates (V for the full softmax).
"""

from __future__ import annotations

import torch

from elmokit.devices import without_autocast
from elmokit.kernels import linear, matmul
from elmokit.model import fused_cell

LOGIT_BUDGET = 1 << 24  # floats of a block's logits (64 MB; the full form holds its probabilities beside them,
# the peak twice that): all N rows of a 10k softmax, blocks of a 100k one
SCORING_ROWS = 512  # rows of a block of `full_softmax_nll` (scoring, no gradients)
SCORING_LOGITS = 1 << 20  # floats of logits it holds at once (4 MB: a block's logits stay in the CPU's cache)


class SoftmaxNllSum(torch.autograd.Function):
    """Summed negative log-likelihood; see the module docstring for the two forms.

    apply(hidden (N, P), weight (K, P), bias (K,), targets (N,) or None, true_logits (N,) or None,
          hits (N,) or None, grad_enabled, product_dtype) -> scalar; `grad_enabled`:
    torch.is_grad_enabled() of the caller (a Function's forward always runs without grad mode, and
    its `needs_input_grad` follows the inputs' requires_grad alone: under torch.no_grad the
    gradients would be computed for nothing); `product_dtype`: None, or torch.bfloat16 for the three
    products' operands in bfloat16 (`Products`)
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, true_logits, hits, grad_enabled, product_dtype=None):
        needs_grad = grad_enabled and (any(ctx.needs_input_grad[:3]) or ctx.needs_input_grad[4])
        total = hidden.new_zeros((), dtype=torch.float64)
        grads = None
        if needs_grad:
            grads = [torch.empty_like(hidden), None, None,  # weight and bias: the first block's, then sums
                     None if true_logits is None else torch.empty_like(true_logits)]
        products = Products(weight, bias, product_dtype)
        block_rows = max(64, LOGIT_BUDGET // weight.shape[0])
        for first in range(0, hidden.shape[0], block_rows):
            rows = slice(first, first + block_rows)
            if true_logits is None:
                total += _full_block(hidden[rows], products, targets[rows], grads, rows)
            else:
                total += _sampled_block(hidden[rows], products, true_logits[rows], hits[rows], grads, rows)
        ctx.grads = grads
        return total.to(hidden.dtype)

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight, grad_bias, grad_true = ctx.grads
        ctx.grads = None
        scale = lambda grad: None if grad is None else grad * grad_total  # noqa: E731
        return scale(grad_hidden), scale(grad_weight), scale(grad_bias), None, scale(grad_true), None, None, None


class Products:
    """The softmax's three products over a block of rows: the logits x W^T + b, and from the
    gradient of the logits G (n, K) the hidden rows' gradient G W and the weight's G^T x. With
    `dtype` bfloat16 (`elmo train --softmax-bf16`) their operands are rounded to bfloat16 (the
    weight once a call: a (V, P) copy), their products summed in float32 inside the kernel and
    returned in bfloat16 (oneDNN's products give their operands' dtype), then widened: the
    logits, the hidden rows' gradient and each block's weight gradient carry a bfloat16 rounding;
    the bias is added in float32, and the softmax, the nll, the bias gradient and the sum of the
    blocks' weight gradients are float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype | None = None):
        self.weight, self.bias = weight, bias
        self.dtype = None if dtype in (None, weight.dtype) else dtype
        self.low_weight = weight if self.dtype is None else weight.to(self.dtype)

    def product(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(n, P) -> the logits' product (n, K) and the bias still to add to it: in float32 the
        logits themselves (the bias inside the product) and None; with `dtype` the product in it
        and the float32 bias."""
        if self.dtype is None:
            return linear(block, self.weight, self.bias), None  # oneDNN's kernel on the CPU (bench/results/train.md)
        return linear(block.to(self.dtype), self.low_weight), self.bias

    def logits(self, block: torch.Tensor) -> torch.Tensor:
        """(n, P) -> (n, K) in the weight's dtype."""
        product, bias = self.product(block)
        return product if bias is None else torch.add(bias, product)

    def accumulate(self, grads: list, grad_logits: torch.Tensor, block: torch.Tensor, rows: slice) -> None:
        """Add a block's gradients, from d nll / d logits (n, K), to grads [hidden, weight, bias,
        true]: its hidden rows' own, the weight's and the bias' summed over the blocks."""
        self.accumulate_products(grads, grad_logits if self.dtype is None else grad_logits.to(self.dtype), block, rows)
        block_bias = grad_logits.sum(dim=0)
        grads[2] = block_bias if grads[2] is None else grads[2].add_(block_bias)

    def accumulate_products(self, grads: list, low_grad: torch.Tensor, block: torch.Tensor, rows: slice) -> None:
        """The hidden rows' gradient into grads[0] and the weight's added into grads[1], from d nll /
        d logits in the products' dtype."""
        low_block = block if self.dtype is None else block.to(self.dtype)
        grads[0][rows] = matmul(low_grad, self.low_weight)  # oneDNN's kernels on the CPU, as the logits
        block_weight = matmul(low_grad.t(), low_block).to(grads[0].dtype)
        grads[1] = block_weight if grads[1] is None else grads[1].add_(block_weight)


def _full_block(block: torch.Tensor, products: Products, targets: torch.Tensor, grads: list | None,
                rows: slice) -> torch.Tensor:
    """The full form on a block of rows (n, P): its nll sum (float64); its gradients into `grads`.
    The probabilities by torch's softmax (a row at a time in cache: one read and one write of the
    logits); each row's nll = logsumexp - target logit, where logsumexp = top - log p(top) (the
    largest probability, at the largest logit `top`, is 1 / sum exp(logit - top)): exact also for a
    target whose own probability is below what float32 holds, and no data-dependent branch."""
    if grads is not None and block.device.type == "cpu":  # training: one compiled pass for what follows the product
        product, bias = products.product(block)
        low_grad = product if product.dtype == torch.float32 else torch.empty_like(product)
        bias_grad = grads[2] if grads[2] is not None else product.new_zeros(product.shape[1], dtype=torch.float32)
        nll = fused_cell.softmax_rows_(product, bias, targets, low_grad, bias_grad)
        if nll is not None:
            grads[2] = bias_grad
            products.accumulate_products(grads, low_grad, block, rows)
            return nll.sum(dtype=torch.float64)
        logits = product if bias is None else torch.add(bias, product)
    else:
        logits = products.logits(block)  # (n, V)
    row_index = torch.arange(len(block), device=block.device)
    top, target_logits = logits.amax(dim=1), logits[row_index, targets]  # (n,)
    probabilities = torch.softmax(logits, dim=1)
    del logits
    nll = top - target_logits - torch.log(probabilities.amax(dim=1))
    if grads is not None:
        probabilities[row_index, targets] -= 1  # d nll / d logit = p - onehot(target)
        products.accumulate(grads, probabilities, block, rows)
    return nll.sum(dtype=torch.float64)


def _sampled_block(block: torch.Tensor, products: Products, true_logits: torch.Tensor, hits: torch.Tensor,
                   grads: list | None, rows: slice) -> torch.Tensor:
    """The sampled form on a block of rows (n, P): the candidates' logits and the true logit as one
    more column, in place: exp(logit - max), the norm; its nll sum (float64), its gradients into
    `grads`."""
    logits = products.logits(block)  # (n, K)
    row_index, columns = torch.arange(len(block), device=block.device), hits.clamp(min=0)
    logits[row_index, columns] = torch.where(hits >= 0, float("-inf"), logits[row_index, columns])  # an accidental
    # hit is not a negative (no data-dependent shape: each row's column written, the others with their own value)
    top = torch.maximum(logits.amax(dim=1), true_logits)
    probabilities = logits.sub_(top[:, None]).exp_()  # exp(logit - max), in place
    target_probability = torch.exp(true_logits - top)
    norm = probabilities.sum(dim=1) + target_probability  # (n,)
    if grads is not None:
        probabilities.div_(norm[:, None])  # d nll / d logit = p for every candidate
        grads[3][rows] = target_probability / norm - 1  # and for the true logit
        products.accumulate(grads, probabilities, block, rows)
    return (torch.log(norm) + top - true_logits).sum(dtype=torch.float64)


class GatherRows(torch.autograd.Function):
    """`weight[rows]` (rows may repeat), whose gradient can come sparse.

    autograd's gradient of `weight[rows]` is a fresh zero-filled (V, P) tensor with the rows'
    gradients scattered in: for a 100k-word softmax a new 51 MB allocation every step, whose page
    faults cost far more than a zero-fill of memory already mapped. With `sparse` and a dense
    `.grad` already on the weight (the trainer keeps this one between steps, zeroed), the gradient
    is returned sparse (COO, each row's gradient at its row) and autograd adds it in place into
    that `.grad`, which stays dense; otherwise it is the dense gradient of plain indexing. The weight's `.grad` holds the same values either way.

    apply(weight (V, P), rows (R,) long, sparse bool) -> (R, P)
    """

    @staticmethod
    def forward(ctx, weight, rows, sparse):
        rows = torch.where(rows < 0, rows + weight.shape[0], rows)  # as indexing reads them (COO ids are >= 0)
        ctx.save_for_backward(rows)
        ctx.weight, ctx.sparse = weight, sparse
        return weight[rows]

    @staticmethod
    def backward(ctx, grad_rows):
        rows, = ctx.saved_tensors
        weight, ctx.weight = ctx.weight, None
        kept = weight.grad
        # torch promises no order for a sparse COO gradient added into a dense one on CUDA: under
        # --deterministic the dense gradient's index_add_ (whose deterministic version it has) instead
        exact = grad_rows.is_cuda and torch.are_deterministic_algorithms_enabled()
        if ctx.sparse and kept is not None and kept.layout == torch.strided and not exact:
            return torch.sparse_coo_tensor(rows[None], grad_rows, weight.shape, check_invariants=False), None, None
        return torch.zeros_like(weight).index_add_(0, rows, grad_rows), None, None


def full_softmax_nll_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                         targets: torch.Tensor, product_dtype: torch.dtype | None = None) -> torch.Tensor:
    """sum_i -log softmax(hidden_i W^T + b)[targets_i]: hidden (N, P), weight (V, P), bias (V,).
    Without gradients (evaluation), `full_softmax_nll`'s sum (float32 products whatever
    `product_dtype`); in the weight's dtype either way. `product_dtype`: see `Products`."""
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (hidden, weight, bias))):
        return full_softmax_nll(hidden, weight, bias, targets).sum(dtype=torch.float64).to(weight.dtype)
    with without_autocast(hidden.device.type):  # float32 logits
        return SoftmaxNllSum.apply(hidden.to(weight.dtype), weight, bias, targets, None, None,
                                   torch.is_grad_enabled(), product_dtype)


@torch.no_grad()
def full_softmax_nll(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                     targets: torch.Tensor) -> torch.Tensor:
    """-log softmax(hidden_i W^T + b)[targets_i] of each row, without gradients (scoring and
    validation): hidden (N, P), weight (V, P), bias (V,), targets (N,) in 0..V-1 -> (N,) float32.

        nll_i = logsumexp_k(hidden_i W_k + b_k) - (hidden_i W_t + b_t),   t = targets_i

    The products run in the weight's dtype, the rest in float32. The logsumexp runs over the
    vocabulary a slice at a time, with a running maximum and a sum rescaled when the maximum grows
    (the online log-sum-exp), in blocks of SCORING_ROWS rows: on the CPU each slice's logits
    (SCORING_LOGITS floats) stay in cache for the passes over them, where the whole (N, V) logits
    of a 100k softmax are written to memory and read back four times; elsewhere a block's logits
    are one slice. The target's logit is its own dot product (its sums in another order than the
    product's: ~1e-7 apart)."""
    if len(targets) and not 0 <= int(targets.min()) <= int(targets.max()) < weight.shape[0]:
        raise IndexError(f"targets must be word ids in 0..{weight.shape[0] - 1} (the softmax's rows), got "
                         f"{int(targets.min())}..{int(targets.max())}")
    with without_autocast(hidden.device.type):
        hidden = hidden.to(weight.dtype)
        target_logits = (torch.einsum("np,np->n", hidden.float(), weight[targets].float())
                         + bias[targets].float())  # (N,)
        totals = [target_logits.new_zeros(0)]
        for block in hidden.split(SCORING_ROWS) if len(hidden) else ():  # (a window may hold no target)
            columns = max(1, SCORING_LOGITS // len(block)) if block.device.type == "cpu" else weight.shape[0]
            top = block.new_full((len(block),), torch.finfo(torch.float32).min, dtype=torch.float32)  # finite:
            norm = torch.zeros_like(top)  # a slice of -inf logits (a -inf bias) adds 0, not NaN
            for first in range(0, weight.shape[0], columns):
                logits = linear(block, weight[first:first + columns], bias[first:first + columns]).float()  # (n, k)
                new_top = torch.maximum(top, logits.amax(dim=1))
                norm.mul_(torch.exp(top - new_top)).add_(logits.sub_(new_top[:, None]).exp_().sum(dim=1))
                top = new_top
            totals.append(norm.log_().add_(top))
        return torch.cat(totals) - target_logits


def sampled_softmax_nll_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                            true_logits: torch.Tensor, hits: torch.Tensor,
                            product_dtype: torch.dtype | None = None) -> torch.Tensor:
    """sum_i -log softmax([true_i, hidden_i W^T + b])[0], candidate `hits[i]` (>= 0) removed:
    hidden (N, P), weight (K, P) and bias (K,) of the sampled candidates, true_logits (N,).
    `product_dtype`: see `Products`."""
    with without_autocast(hidden.device.type):  # float32 logits
        return SoftmaxNllSum.apply(hidden.to(weight.dtype), weight, bias, None, true_logits.to(weight.dtype), hits,
                                   torch.is_grad_enabled(), product_dtype)
