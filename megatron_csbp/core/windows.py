"""Which layers attend through a sliding window, and how far back a window reaches (docs/algorithm.md §3).

A layer is global (`GLOBAL`: the BDLM mask as it is) or sliding (`Sliding(left)`): every row then sees, of the
clean keys its rule lets it see, only those at positions `>= anchor - left`, where the row's anchor is the first
position of the unit it attends as: its own position for a token-causal clean row, its block's first position
for a row of a bidirectional block (a noisy row, a block-causal clean row). So a unit sees the `left` clean
positions before it and itself: a token-causal clean row the keys `[p - left, p]` (megatron-core's and
Transformer Engine's `window_size (left, 0)` of a causal LM; transformers' `sliding_window = left + 1`), a
noisy block at `s` the clean keys `[s - left, s)` (DiffusionGemma's canvas reads the `sliding_window - 1`
clean states a sliding layer's cache keeps; Turbo-dLLM's `clean_context_window`), a block-causal clean block
`[s - left, its end)`. The noisy keys a noisy row sees (its own block, whole) do not depend on the window.

The pattern over layers is megatron-core's (`TransformerConfig.window_size`, `window_attn_skip_freq`; its
`is_layer_window_attention`): with a window, layer `n` (1-based) is sliding unless `window_attn_skip_freq` is
an int `N` with `n % N == 0`, or a list whose entry `n - 1` is 0. So the same flags mean the same layers as
in Megatron-LM.

Standard library only (the planner runs without torch); `starts` works on ints and torch tensors alike.
"""

import dataclasses

WINDOW_SIZE = "--window-size"
SKIP_FREQ = "--window-attn-skip-freq"


@dataclasses.dataclass(frozen=True)
class Window:
    """A global layer (the base): no lower bound on the clean keys a row sees."""

    sliding = False
    left = None

    def starts(self, anchors):
        """The first clean position each row sees, from its anchor (0: all of them)."""
        return anchors * 0

    @property
    def window_size(self):
        """megatron-core's `window_size` of the layer (None: global)."""
        return None

    def __str__(self):
        return "global"


@dataclasses.dataclass(frozen=True)
class Sliding(Window):
    """A sliding layer: a unit sees the `left` clean positions before its anchor, and itself."""

    left: int = 0
    sliding = True

    def __post_init__(self):
        if isinstance(self.left, bool) or not isinstance(self.left, int) or self.left < 0:
            raise ValueError(f"a sliding window reaches back left >= 0 positions; got {self.left!r}")

    def starts(self, anchors):
        return anchors - self.left

    @property
    def window_size(self):
        return (self.left, 0)

    @property
    def hf_sliding_window(self) -> int:
        """transformers' `sliding_window` of the same layer: the keys a token sees, itself included."""
        return self.left + 1

    def __str__(self):
        return f"sliding({self.left})"


GLOBAL = Window()


def window_size_problem(window_size, skip_freq, num_layers: int) -> str | None:
    """What the kernels cannot do of `--window-size` and `--window-attn-skip-freq` (one line naming the flag and
    the fix), or None."""
    if window_size is None:
        if skip_freq is None:
            return None
        return (f"{SKIP_FREQ} {_shown(skip_freq)} picks the sliding-window layers, but there is no {WINDOW_SIZE}; "
                f"give {WINDOW_SIZE} LEFT,0 or drop {SKIP_FREQ}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(x, bool) or not isinstance(x, int) for x in window_size)):
        shown = ",".join(map(str, window_size)) if isinstance(window_size, (tuple, list)) else _shown(window_size)
        return f"{WINDOW_SIZE} {shown}: give two integers LEFT,RIGHT, e.g. 511,0"
    left, right = window_size
    if right != 0:
        return (f"{WINDOW_SIZE} {left},{right}: a right window (RIGHT != 0) would let a clean row see clean tokens "
                f"after its own, whose noisy copies later blocks must predict; the kernels take a left window only: "
                f"give {WINDOW_SIZE} {left},0")
    if left < -1:
        return f"{WINDOW_SIZE} {left},0: LEFT is the positions a token sees before itself, >= 0 (or -1: no window)"
    if skip_freq is None or (isinstance(skip_freq, int) and not isinstance(skip_freq, bool)):
        if skip_freq is not None and skip_freq < 1:
            return (f"{SKIP_FREQ} {skip_freq}: give N >= 1 (every N-th layer global) or one 0 (global) or 1 "
                    f"(sliding) per layer")
        return None
    if len(skip_freq) != num_layers or any(value not in (0, 1) for value in skip_freq):
        return (f"{SKIP_FREQ} {_shown(skip_freq)} names {len(skip_freq)} layers, but --num-layers is {num_layers}: "
                f"give one 0 (global) or 1 (sliding) per layer, or an int N (every N-th layer global)")
    return None


def layer_windows(window_size, skip_freq, num_layers: int) -> tuple:
    """The window of each layer `1 .. num_layers`, in order: megatron-core's reading of the two flags (a
    `window_size` LEFT of -1 is its infinite window: global)."""
    problem = window_size_problem(window_size, skip_freq, num_layers)
    if problem:
        raise ValueError(problem)
    if window_size is None or window_size[0] == -1:
        return (GLOBAL,) * num_layers
    window = Sliding(window_size[0])
    return tuple(window if is_sliding(skip_freq, layer) else GLOBAL for layer in range(1, num_layers + 1))


def is_sliding(skip_freq, layer_number: int) -> bool:
    """Whether layer `layer_number` (1-based) of a model with a window slides, by `window_attn_skip_freq`."""
    if skip_freq is None:
        return True
    if isinstance(skip_freq, int):
        return layer_number % skip_freq != 0
    return bool(skip_freq[layer_number - 1])


def _shown(value) -> str:
    text = str(list(value) if isinstance(value, tuple) else value).replace(" ", "")
    return text if len(text) <= 60 else text[:57] + "..."
