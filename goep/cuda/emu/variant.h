// variant.h: one compiled variant of a kernel source. The including file defines EMU_ID (a
// unique number), EMU_KEY (the canonical define string the Go loader looks up), EMU_FILE
// (1: intranode.cu, 2: layout.cu) and the PYEP_* constants.
#include "emu.h"
#include "registry.h"

#define EMU_CAT2(a, b) a##b
#define EMU_CAT(a, b) EMU_CAT2(a, b)
#define EMU_NS EMU_CAT(variant_, EMU_ID)

// The entry points are extern "C": give each variant its own names.
#define pyep_notify EMU_CAT(pyep_notify_, EMU_ID)
#define pyep_prologue EMU_CAT(pyep_prologue_, EMU_ID)
#define pyep_dispatch EMU_CAT(pyep_dispatch_, EMU_ID)
#define pyep_combine EMU_CAT(pyep_combine_, EMU_ID)
#define pyep_layout EMU_CAT(pyep_layout_, EMU_ID)

namespace EMU_NS {
namespace pyep {
using namespace ::pyep;
}
#if EMU_FILE == 1
#include "kernels_intranode.h"
#else
#include "kernels_layout.h"
#endif
}  // namespace EMU_NS

namespace {
#if EMU_FILE == 2
const int reg_layout = ::emu::add(
    EMU_KEY, "pyep_layout",
    [](const void* p) { EMU_NS::pyep::pyep_layout(*static_cast<const EMU_NS::pyep::LayoutParams*>(p)); },
    sizeof(EMU_NS::pyep::LayoutParams));
#elif defined(PYEP_NOTIFY)
const int reg_notify = ::emu::add(
    EMU_KEY, "pyep_notify",
    [](const void* p) { EMU_NS::pyep::pyep_notify(*static_cast<const EMU_NS::pyep::NotifyParams*>(p)); },
    sizeof(EMU_NS::pyep::NotifyParams));
const int reg_prologue = ::emu::add(
    EMU_KEY, "pyep_prologue",
    [](const void* p) { EMU_NS::pyep::pyep_prologue(*static_cast<const EMU_NS::pyep::PrologueParams*>(p)); },
    sizeof(EMU_NS::pyep::PrologueParams));
#elif defined(PYEP_DISPATCH)
const int reg_dispatch = ::emu::add(
    EMU_KEY, "pyep_dispatch",
    [](const void* p) { EMU_NS::pyep::pyep_dispatch(*static_cast<const EMU_NS::pyep::DispatchParams*>(p)); },
    sizeof(EMU_NS::pyep::DispatchParams));
#elif defined(PYEP_COMBINE)
const int reg_combine = ::emu::add(
    EMU_KEY, "pyep_combine",
    [](const void* p) { EMU_NS::pyep::pyep_combine(*static_cast<const EMU_NS::pyep::CombineParams*>(p)); },
    sizeof(EMU_NS::pyep::CombineParams));
#endif
}  // namespace
