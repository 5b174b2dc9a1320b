// Umbrella header: the whole public API of attn.
#pragma once

#include "attn/error.hpp"
#include "attn/functional.hpp"
#include "attn/gpt.hpp"
#include "attn/gpt_train.hpp"
#include "attn/kv_cache.hpp"
#include "attn/memory.hpp"
#include "attn/modules.hpp"
#include "attn/multihead.hpp"
#include "attn/optim.hpp"
#include "attn/print.hpp"
#include "attn/random.hpp"
#include "attn/safetensors.hpp"
#include "attn/sdpa.hpp"
#include "attn/tensor.hpp"
#include "attn/varlen.hpp"
