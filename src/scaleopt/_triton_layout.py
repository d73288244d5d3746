"""The tables the Triton kernels read, column by column: ``_triton`` writes them and
``_triton_kernels`` reads them, both by these names.

* ``ptrs`` (int64, a row per tensor): :data:`PTRS`;
* ``grads`` (int64, one per tensor, in the group's order): the address of its gradient, made
  for a step's gradients (they may be elsewhere than the last step's, where nothing else moved);
* ``scal`` (float32, the step table, a row per tensor): :data:`SCAL`; Adam's: :data:`ADAM`;
* ``chunks`` (int64, a row per program): :data:`CHUNKS`.
"""

#: a tensor's row of ``ptrs``: the addresses of its weight (a split master's bfloat16 upper
#: halves), moments and 16-bit part w16 (0: none), its place in the group (its row of ``grads`` and
#: of the step table), and for int8 moments the addresses of their scales, the length of a row
#: of blocks and where the local piece starts in the whole tensor (the rounding's index)
PTRS = ("w", "m", "v", "w16", "index", "m_scale", "v_scale", "row_len", "offset")
#: a tensor's row of the step table: its learning rate, weight decay, whether it adapts, the
#: gradient's multiplier, the bias corrections 1 - beta1^t and sqrt(1 - beta2^t), and t
SCAL = ("lr", "weight_decay", "adapt", "grad_mult", "bc1", "bc2_sqrt", "step")
#: a tensor's row of Adam's step table (``adam_apply``), the C kernel's scalars: lr / (1 -
#: beta1^t), sqrt(1 - beta2^t) and its reciprocal, the L2 decay (Adam), the decoupled decay's
#: factor 1 - lr * weight_decay (AdamW), the gradient's multiplier, and t
ADAM = ("step_size", "bc2_sqrt", "inv_bc2_sqrt", "weight_decay_l2", "decay", "grad_mult", "step")
#: a program's row of ``chunks``: its tensor (a row of ``ptrs``), where its chunk starts (an
#: element, or an int8 block) and its slot for partial sums
CHUNKS = ("tensor", "start", "slot")
#: what a launch with ``ALIGNED`` may assume: every address a multiple of this many bytes and
#: every size (an int8 row's length) of this many elements, so 16-byte vectors
VECTOR = 16
#: ``ALIGNED``'s value for int8 moments whose rows are whole blocks (a multiple of 256 elements:
#: a block is then 256 consecutive elements, and a tile's place needs no division)
WHOLE_BLOCKS = 2
