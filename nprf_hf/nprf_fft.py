# coding=utf-8
"""The paper's algorithm: the Toeplitz product through real FFTs of the m * e channels of phi_k u^T,
O(n log n) per channel. Without a band (a bias learned per distance) it is the fastest past
`nprf_dispatch.Routing`. Execution modes side by side: autograd and torch.compile (per head,
traced), and inference (one reused buffer, `fft_toeplitz_inference`: `nprf_dispatch`'s "inference" row, and what
`fft_toeplitz_attention` runs itself when nothing it reads requires grad).
"""

import torch
import torch.nn.functional as F


def fft_toeplitz_attention(phi_q, phi_k, u, c):
    """The paper's algorithm: D_i = sum_j c_{j-i} phi_k_j u_j^T for all i through real FFTs of the
    m * e channels of phi_k u^T over the (contiguous) sequence axis, then z_i = phi_q_i^T D_i.
    One head at a time, to bound the memory of the [B, m, e, n] channel tensor."""
    n = phi_q.shape[-2]
    kernel_f, length = fft_kernel(c, n)
    # The inference path writes into strided `out=` views, which dynamo cannot trace; compiled, the per-head
    # path below is traced instead (inductor plans its buffers itself).
    if not torch.compiler.is_compiling() and (
        not torch.is_grad_enabled() or not any(t.requires_grad for t in (phi_q, phi_k, u, kernel_f))
    ):
        return fft_toeplitz_inference(phi_q, phi_k, u, kernel_f, length)
    heads = []
    for h in range(phi_q.shape[1]):
        channels = phi_k[:, h].transpose(-1, -2).unsqueeze(2) * u[:, h].transpose(-1, -2).unsqueeze(1)  # [B, m, e, n]
        spectrum = torch.fft.rfft(F.pad(channels, (0, length - n)))  # padding first is much faster than rfft(n=)
        toeplitz = torch.fft.irfft(spectrum * kernel_f[h], n=length)[..., :n]  # D_i for every i: [B, m, e, n]
        heads.append((toeplitz * phi_q[:, h].transpose(-1, -2).unsqueeze(2)).sum(1).transpose(-1, -2))
    return torch.stack(heads, dim=1)


def fft_kernel(c, n):
    """(kernel_f [H, length // 2 + 1], length): the spectrum of C's convolution kernel over `fft_length(2n - 1)`."""
    length = fft_length(2 * n - 1)
    # Convolution kernel k_t = c_{-t}, placed circularly: t = 0..n-1 first, t = -(n-1)..-1 last.
    zeros = c.new_zeros(c.shape[0], length - (2 * n - 1))
    kernel = torch.cat([c[:, :n].flip(-1), zeros, c[:, n:].flip(-1)], dim=-1)
    return torch.fft.rfft(kernel, n=length), length


def fft_toeplitz_inference(phi_q, phi_k, u, kernel_f, length):
    """`fft_toeplitz_attention` without autograd: the channels are written straight into one zero-padded
    buffer, the FFTs reuse their outputs across heads, and the readout accumulates over the m features,
    so that the FFTs are most of the time."""
    batch, heads, n, m = phi_q.shape
    e = u.shape[-1]
    channels = phi_q.new_zeros(batch, m, e, length)  # the tail [n, length) stays zero for every head
    spectrum = toeplitz = None
    out = phi_q.new_empty(batch, heads, e, n)
    for h in range(heads):
        torch.mul(phi_k[:, h].transpose(-1, -2).unsqueeze(2), u[:, h].transpose(-1, -2).unsqueeze(1), out=channels[..., :n])
        spectrum = torch.fft.rfft(channels, out=spectrum)
        spectrum.mul_(kernel_f[h])
        toeplitz = torch.fft.irfft(spectrum, n=length, out=toeplitz)  # D_i for every i in [..., :n]
        q_h = phi_q[:, h].transpose(-1, -2).unsqueeze(2)  # [B, m, 1, n]
        acc = torch.mul(toeplitz[:, 0, :, :n], q_h[:, 0], out=out[:, h])
        for feature in range(1, m):
            acc.addcmul_(toeplitz[:, feature, :, :n], q_h[:, feature])
    return out.transpose(-1, -2)


def fft_length(minimum):
    """Smallest 2^a 3^b 5^c >= minimum (fast sizes for pocketfft / cuFFT)."""
    best = 1 << max(minimum - 1, 0).bit_length()
    power5 = 1
    while power5 < best:
        power35 = power5
        while power35 < best:
            size = power35
            while size < minimum:
                size *= 2
            best = min(best, size)
            power35 *= 3
        power5 *= 5
    return best
