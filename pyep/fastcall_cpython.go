//go:build cgo

// The per-call exports as CPython METH_FASTCALL functions: the C half (fastcall.go the Go one).
//
// gopy's wrapper of an export takes its arguments as a tuple, parses them against a keyword
// list and a format string, and releases and retakes the GIL from Go (two more cgo calls); for
// the 33 to 78 integers of a dispatch or a combine that is 2.6-3.4 µs a call on the GPU hosts.
// Here Python passes the integers as its argument array, each is read with PyLong_AsLongLong,
// and the GIL is released around the Go call from C. No Python header is needed: the few
// CPython functions used are part of its stable ABI and looked up in the running interpreter
// (pyep_fast_init), so the Go package builds and tests without Python.

package pyep

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>

int64_t pyepFastCall(int fn, int64_t* v, int n, int given, char** err);  // fastcall.go

typedef struct _object PyObject;
typedef intptr_t Py_ssize_t;

// CPython's PyMethodDef, and its METH_FASTCALL flag (both in the stable ABI since 3.10).
typedef struct {
    const char* ml_name;
    void* ml_meth;
    int ml_flags;
    const char* ml_doc;
} pyep_method_def;
#define PYEP_METH_FASTCALL 0x0080

#define PYEP_FAST_MAX_ARGS 96  // above the widest export (DispatchQueued, 78; FastCalls checks)
#define PYEP_FAST_CALLS 24

static long long (*py_as_long_long)(PyObject*);
static PyObject* (*py_from_long_long)(long long);
static PyObject* (*py_err_occurred)(void);
static void (*py_err_set_string)(PyObject*, const char*);
static void* (*py_save_thread)(void);
static void (*py_restore_thread)(void*);
static PyObject** py_runtime_error;

static pyep_method_def defs[PYEP_FAST_CALLS + 1];

static PyObject* fast_call(int fn, PyObject* const* args, Py_ssize_t nargs) {
    int64_t v[PYEP_FAST_MAX_ARGS];
    const Py_ssize_t n = nargs < PYEP_FAST_MAX_ARGS ? nargs : PYEP_FAST_MAX_ARGS;
    for (Py_ssize_t i = 0; i < n; i++) {
        const long long x = py_as_long_long(args[i]);
        if (x == -1 && py_err_occurred()) return NULL;  // not an integer: TypeError, or OverflowError
        v[i] = (int64_t)x;
    }
    char* err = NULL;
    void* state = py_save_thread();
    const int64_t r = pyepFastCall(fn, v, (int)n, (int)nargs, &err);
    py_restore_thread(state);
    if (err != NULL) {
        py_err_set_string(*py_runtime_error, err);
        free(err);
        return NULL;
    }
    return py_from_long_long((long long)r);
}

#define PYEP_FAST(i) \
    static PyObject* fast_##i(PyObject* self, PyObject* const* args, Py_ssize_t n) { return fast_call(i, args, n); }
PYEP_FAST(0) PYEP_FAST(1) PYEP_FAST(2) PYEP_FAST(3) PYEP_FAST(4) PYEP_FAST(5) PYEP_FAST(6) PYEP_FAST(7)
PYEP_FAST(8) PYEP_FAST(9) PYEP_FAST(10) PYEP_FAST(11) PYEP_FAST(12) PYEP_FAST(13) PYEP_FAST(14) PYEP_FAST(15)
PYEP_FAST(16) PYEP_FAST(17) PYEP_FAST(18) PYEP_FAST(19) PYEP_FAST(20) PYEP_FAST(21) PYEP_FAST(22) PYEP_FAST(23)

static void* const trampolines[PYEP_FAST_CALLS] = {
    fast_0,  fast_1,  fast_2,  fast_3,  fast_4,  fast_5,  fast_6,  fast_7,  fast_8,  fast_9,  fast_10, fast_11,
    fast_12, fast_13, fast_14, fast_15, fast_16, fast_17, fast_18, fast_19, fast_20, fast_21, fast_22, fast_23,
};

int pyep_fast_capacity(void) { return PYEP_FAST_CALLS; }
int pyep_fast_max_args(void) { return PYEP_FAST_MAX_ARGS; }

// The method table of `count` calls named `names` (kept by the caller), ended by a NULL name;
// NULL when the process has no CPython (a Go test) or count is above the trampolines.
void* pyep_fast_init(const char* const* names, int count) {
    if (count > PYEP_FAST_CALLS) return NULL;
    py_as_long_long = (long long (*)(PyObject*))dlsym(RTLD_DEFAULT, "PyLong_AsLongLong");
    py_from_long_long = (PyObject * (*)(long long)) dlsym(RTLD_DEFAULT, "PyLong_FromLongLong");
    py_err_occurred = (PyObject * (*)(void)) dlsym(RTLD_DEFAULT, "PyErr_Occurred");
    py_err_set_string = (void (*)(PyObject*, const char*))dlsym(RTLD_DEFAULT, "PyErr_SetString");
    py_save_thread = (void* (*)(void))dlsym(RTLD_DEFAULT, "PyEval_SaveThread");
    py_restore_thread = (void (*)(void*))dlsym(RTLD_DEFAULT, "PyEval_RestoreThread");
    py_runtime_error = (PyObject**)dlsym(RTLD_DEFAULT, "PyExc_RuntimeError");
    if (!py_as_long_long || !py_from_long_long || !py_err_occurred || !py_err_set_string || !py_save_thread ||
        !py_restore_thread || !py_runtime_error)
        return NULL;
    for (int i = 0; i < count; i++) {
        defs[i].ml_name = names[i];
        defs[i].ml_meth = trampolines[i];
        defs[i].ml_flags = PYEP_METH_FASTCALL;
        defs[i].ml_doc = NULL;
    }
    defs[count].ml_name = NULL;
    return defs;
}
*/
import "C"
