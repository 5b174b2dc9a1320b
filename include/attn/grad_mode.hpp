// Whether module forwards record what their backward needs (torch.is_grad_enabled()).
//
// Modules save their inputs and intermediate results on every forward so that backward() can
// run, unless gradients are disabled on the calling thread: inside a NoGradGuard's scope (as
// `with torch.no_grad():`) a forward saves nothing and drops any context saved earlier, so a
// later backward() throws instead of differentiating a stale forward. The flag is thread-local,
// as PyTorch's.
#pragma once

namespace attn {

bool is_grad_enabled();
void set_grad_enabled(bool enabled);

// RAII: disables gradient recording until destroyed, then restores the previous mode.
class NoGradGuard {
 public:
  NoGradGuard() : previous_(is_grad_enabled()) { set_grad_enabled(false); }
  ~NoGradGuard() { set_grad_enabled(previous_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

}  // namespace attn
