// Test-only stand-in for torch_npu's OpCommand.h: a custom handler runs at once, in the caller's
// thread (torch_npu runs it later, in order, on its task queue).
#pragma once
#include <functional>
#include <string>
#include <utility>

namespace at_npu {
namespace native {

class OpCommand {
public:
    OpCommand& Name(const std::string& name) { name_ = name; return *this; }
    OpCommand& SetCustomHandler(std::function<int()> handler) { handler_ = std::move(handler); return *this; }
    void Run() { handler_(); }

private:
    std::string name_;
    std::function<int()> handler_;
};

}  // namespace native
}  // namespace at_npu
