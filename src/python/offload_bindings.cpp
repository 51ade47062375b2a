// Python bindings of the offload layer (tensormem.offload builds the torch optimizers on them).

#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <future>
#include <system_error>
#include <string>
#include <type_traits>
#include <vector>

#include "tensormem/io/io_engine.hpp"
#include "tensormem/offload/offloaded_optimizer.hpp"
#include "engine_name.hpp"
#include "file_name.hpp"
#include "numpy_abi.hpp"
#include "signals.hpp"
#include "whole_number.hpp"
#include "tensormem/core/detail/thread_start.hpp"

namespace py = pybind11;
using namespace tensormem;
using python::u64;
using python::whole;
using python::engine_of;
using python::file_name;

namespace {

offload::optimizer_kind parse_kind(const std::string& kind) {
  if (kind == "adamw") return offload::optimizer_kind::adamw;
  if (kind == "adam") return offload::optimizer_kind::adam;
  if (kind == "sgd") return offload::optimizer_kind::sgd;
  throw std::invalid_argument("optimizer kind must be 'adamw', 'adam' or 'sgd', not '" + kind + "'");
}

int parse_simd(const std::string& simd) {
  if (simd.empty() || simd == "auto") return -1;
  if (simd == "scalar") return static_cast<int>(offload::simd_level::scalar);
  if (simd == "avx2") return static_cast<int>(offload::simd_level::avx2);
  if (simd == "avx512") return static_cast<int>(offload::simd_level::avx512);
  throw std::invalid_argument("simd must be 'auto', 'scalar', 'avx2' or 'avx512', not '" + simd + "'");
}

offload::adam_arithmetic parse_arithmetic(const std::string& arithmetic) {
  if (arithmetic == "torch1") return offload::adam_arithmetic::torch1;
  if (arithmetic == "torch2") return offload::adam_arithmetic::torch2;
  throw std::invalid_argument("arithmetic must be 'torch1' or 'torch2', not '" + arithmetic + "'");
}

template <class T>
std::vector<T*> pointers(const std::vector<std::uintptr_t>& addresses) {
  std::vector<T*> out;
  out.reserve(addresses.size());
  for (const std::uintptr_t a : addresses) out.push_back(reinterpret_cast<T*>(a));
  return out;
}

// A hyperparameter of a parameter group as the step reads it (a scheduler or the user may
// have set it to anything since the constructor checked it): TypeError naming it and what it
// is where it cannot be read as one ("Unable to cast Python instance to C++ type" before).
template <class T>
T hyper_value(const py::dict& d, const char* key) {
  const py::object v = d[key];
  try {
    return v.cast<T>();
  } catch (const py::cast_error&) {
    const char* want = std::is_same_v<T, bool> ? "True or False" : std::is_same_v<T, double> ? "a number" : "two numbers";
    throw py::type_error(std::string("param_groups: ") + key + " must be " + want + ", not " +
                         py::repr(v).cast<std::string>() + " (" + py::str(v.get_type().attr("__name__")).cast<std::string>() +
                         ")");
  }
}

// `step_thread`: whether the step ran on a thread of its own (else no thread could start).
py::dict to_dict(const offload::step_stats& s, bool step_thread = true) {
  std::string fallback;
  if (!step_thread) {
    fallback = "no thread could be started for the step (a limit on threads): it ran on the calling thread, where "
               "Ctrl-C waits for its end";
  }
  if (s.unlocked_slabs != 0) {
    io::detail::append_reason(fallback, std::to_string(s.unlocked_slabs) + " staging slab(s) could not be "
                                        "page-locked (RLIMIT_MEMLOCK): unlocked memory (allow_unlocked)");
  }
  if (!s.collector_thread) {
    io::detail::append_reason(fallback, "no thread could be started to collect the step's write-backs: the step "
                                        "collected them itself");
  }
  py::dict d;
  d["fallback"] = fallback;
  d["seconds"] = s.seconds;
  d["compute_seconds"] = s.compute_seconds;
  d["io_wait_seconds"] = s.io_wait_seconds;
  d["overlap_ratio"] = s.overlap_ratio;
  d["bytes_read"] = s.bytes_read;
  d["bytes_written"] = s.bytes_written;
  d["pinned_bytes"] = s.pinned_bytes;
  d["pinned_high_water"] = s.pinned_high_water;
  d["groups"] = s.groups;
  d["elements"] = s.elements;
  d["unlocked_slabs"] = s.unlocked_slabs;
  return d;
}

// Calls f(index, record) with the GIL held. The record goes to Python as a (fields, stride)
// float32 array: a copy that f may keep (`copy`), or the staging buffer itself, which the
// pipeline reuses for the next sub-group, so that neither it nor a view of it may outlive the
// call (a RuntimeError if one does). `writable`: what f leaves in the array is the record.
void call_with_record(const py::function& f, const offload::offloaded_optimizer& o,
                      const offload::offloaded_optimizer::group& g, float* record, bool copy, bool writable) {
  py::gil_scoped_acquire gil;
  python::require_numpy_abi("a record's array");
  const auto fields = static_cast<py::ssize_t>(o.fields().size());
  const auto stride = static_cast<py::ssize_t>(g.stride);
  const auto bytes = static_cast<std::size_t>(fields * stride) * sizeof(float);
  if (copy) {
    py::array_t<float> a({fields, stride});
    std::memcpy(a.mutable_data(), record, bytes);
    f(g.index, a);
    if (writable) {
      if (static_cast<std::size_t>(a.nbytes()) != bytes) {  // resize(..., refcheck=False)
        throw std::runtime_error("the record of sub-group " + std::to_string(g.index) + " was resized by the callback");
      }
      std::memcpy(record, a.data(), bytes);
    }
    return;
  }
  // A view counts as a reference to the array it was made from (its base).
  py::array_t<float> a({fields, stride}, {stride * py::ssize_t{4}, py::ssize_t{4}}, record, py::none());
  if (!writable) a.attr("setflags")(py::arg("write") = false);
  f(g.index, a);
  if (a.ref_count() > 1) {
    throw std::runtime_error("the record of sub-group " + std::to_string(g.index) +
                             " (or a view of it) was kept after the callback returned; with copy=False it is "
                             "valid only during the call: copy what you need (record.copy()), or pass copy=True");
  }
}

}  // namespace

void bind_offload(py::module_& m) {
  static py::exception<offload::offload_error> offload_error_type(m, "OffloadError", PyExc_OSError);
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const offload::offload_error& e) {
      py::object type = py::reinterpret_borrow<py::object>(offload_error_type.ptr());
      py::object err = type(e.error(), python::message_text(e.what()),
                            e.path().empty() ? py::object(py::none()) : py::object(python::python_file_name(e.path())));
      err.attr("tensor") = e.tensor();
      // A step that could not be undone: the parameters that may hold its values.
      const auto* not_undone = dynamic_cast<const offload::step_not_undone*>(&e);
      err.attr("not_undone") = not_undone != nullptr ? py::cast(not_undone->parameters()) : py::object(py::none());
      PyErr_SetObject(offload_error_type.ptr(), err.ptr());
    }
  });

  m.def("simd_level", [] { return std::string(offload::to_string(offload::best_simd_level())); },
        "The widest vector instruction set the optimizer kernels use on this processor.");

  m.def("adam_update", [](std::uintptr_t param, std::uintptr_t grad, std::uintptr_t m_, std::uintptr_t v,
                          std::size_t n, double lr, double beta1, double beta2, double eps, double weight_decay,
                          bool decoupled, std::uint64_t step, const std::string& simd, const std::string& arithmetic) {
          const int level = parse_simd(simd);
          const offload::adam_arithmetic rule = parse_arithmetic(arithmetic);
          const auto l = level < 0 ? offload::best_simd_level() : static_cast<offload::simd_level>(level);
          if (!offload::simd_supported(l)) throw std::invalid_argument("this processor has no " + simd);
          if (step == 0) throw std::invalid_argument("adam_update: step counts from 1");
          py::gil_scoped_release release;
          offload::adam_update(reinterpret_cast<float*>(param), reinterpret_cast<const float*>(grad), nullptr,
                               reinterpret_cast<float*>(m_), reinterpret_cast<float*>(v), n,
                               offload::make_adam_scalars(lr, beta1, beta2, eps, weight_decay, decoupled, step, rule), l);
        }, py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("n"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("decoupled") = true, py::arg("step") = 1, py::arg("simd") = "auto", py::arg("arithmetic") = "torch1",
        "The in-memory Adam/AdamW kernel on float32 arrays given by address (for benchmarks); arithmetic "
        "'torch1' or 'torch2' rounds the first moment as PyTorch 1.x or 2.x does.");

  py::class_<offload::offloaded_optimizer>(m, "OffloadedOptimizer",
                                           "Optimizer state in a striped swap space (see tensormem.offload).")
      .def(py::init([](std::vector<std::uint64_t> numels, const std::string& kind, bool offload_master,
                       u64 group_bytes, u64 pinned_budget, const std::vector<file_name>& swap_dirs,
                       whole<unsigned> rank, whole<std::size_t> stripe_bytes, const std::vector<u64>& capacity_bytes,
                       const std::string& engine, whole<unsigned> rings, whole<std::size_t> block_bytes,
                       const std::string& name, const std::string& simd, const std::string& arithmetic,
                       bool allow_unlocked) {
             offload::optimizer_options o;
             o.arithmetic = parse_arithmetic(arithmetic);
             o.kind = parse_kind(kind);
             o.offload_master = offload_master;
             o.group_bytes = group_bytes;
             o.pipeline.pinned_budget = pinned_budget;
             o.swap.folders = python::name_bytes(swap_dirs);
             o.swap.rank = rank;
             o.swap.stripe_bytes = stripe_bytes;
             o.swap.capacity_bytes.assign(capacity_bytes.begin(), capacity_bytes.end());
             o.swap.io.engine = engine_of(engine);
             o.swap.io.rings = rings;
             o.swap.io.block_bytes = block_bytes;
             o.name = name;
             o.simd = parse_simd(simd);
             o.allow_unlocked_fallback = allow_unlocked;
             return std::make_unique<offload::offloaded_optimizer>(std::move(numels), o);
           }),
           py::arg("numels"), py::arg("kind") = "adamw", py::arg("offload_master") = true,
           py::arg("group_bytes") = std::uint64_t{32} << 20, py::arg("pinned_budget") = std::uint64_t{256} << 20,
           py::arg("swap_dirs") = std::vector<file_name>{}, py::arg("rank") = 0,
           py::arg("stripe_bytes") = std::size_t{8} << 20, py::arg("capacity_bytes") = std::vector<std::uint64_t>{},
           py::arg("engine") = "uring", py::arg("rings") = 1, py::arg("block_bytes") = std::size_t{1} << 20,
           py::arg("name") = "", py::arg("simd") = "auto", py::arg("arithmetic") = "torch1",
           py::arg("allow_unlocked") = false)
      .def("initialize", [](offload::offloaded_optimizer& o, const std::vector<std::uintptr_t>& params) {
             const auto p = pointers<const float>(params);
             py::gil_scoped_release release;
             o.initialize(p);
           }, py::arg("params"))
      .def("step", [](offload::offloaded_optimizer& o, const std::vector<std::uintptr_t>& params,
                      const std::vector<std::uintptr_t>& grads, const std::vector<py::dict>& hyper) {
             std::vector<offload::param_hyper> h;
             for (const py::dict& d : hyper) {
               offload::param_hyper x;
               x.lr = hyper_value<double>(d, "lr");
               x.weight_decay = hyper_value<double>(d, "weight_decay");
               if (d.contains("betas")) {
                 const auto b = hyper_value<std::pair<double, double>>(d, "betas");
                 x.beta1 = b.first;
                 x.beta2 = b.second;
               }
               if (d.contains("eps")) x.eps = hyper_value<double>(d, "eps");
               if (d.contains("momentum")) x.momentum = hyper_value<double>(d, "momentum");
               if (d.contains("dampening")) x.dampening = hyper_value<double>(d, "dampening");
               if (d.contains("nesterov")) x.nesterov = hyper_value<bool>(d, "nesterov");
               h.push_back(x);
             }
             const auto p = pointers<float>(params);
             const auto g = pointers<const float>(grads);
             // From inside a visit or rewrite callback the step is refused on this thread (on
             // another it would wait for the callback, which waits for it).
             if (o.called_from_this_thread()) return to_dict(o.step(p, g, h));
             // Otherwise it runs on a thread of its own while this one answers Ctrl-C: the
             // step is then told to stop, and KeyboardInterrupt comes out once it has (undone,
             // or finished where it could no longer be undone).
             std::atomic<bool> stop{false};
             std::future<offload::step_stats> step;
             try {
               step = std::async(std::launch::async, [&] {
                 core::detail::prepare_thread_for_exceptions();
                 return o.step(p, g, h, [&] { return stop.load(std::memory_order_relaxed); });
               });
             } catch (const std::system_error&) {  // no thread (EAGAIN): the step runs here
               offload::step_stats st;
               {
                 py::gil_scoped_release release;
                 st = o.step(p, g, h);
               }
               return to_dict(st, false);
             }
             try {
               python::wait_answering_signals([&](auto deadline) {
                 return step.wait_until(deadline) == std::future_status::ready;
               });
             } catch (...) {
               stop.store(true, std::memory_order_relaxed);
               {
                 py::gil_scoped_release release;
                 step.wait();
               }
               // A step that could not be undone says so rather than the interrupt: its
               // parameters need restore_parameters.
               const std::exception_ptr interrupt = std::current_exception();
               try {
                 step.get();
               } catch (const offload::step_not_undone&) {
                 throw;
               } catch (...) {
               }
               std::rethrow_exception(interrupt);
             }
             return to_dict(step.get());
           }, py::arg("params"), py::arg("grads"), py::arg("hyper"),
           "One step; a gradient address of 0 skips that parameter. Returns the step's statistics, whose "
           "'fallback' says where a thread could not be started (the step then runs on this thread). "
           "Ctrl-C raises KeyboardInterrupt: with the master copy offloaded the step is first undone "
           "(parameters and state as before it; rereading the updated sub-groups' master copies), without it the step is undone only "
           "if no parameter had changed yet, else it finishes first (`steps` tells which).")
      .def("restore_parameters", [](offload::offloaded_optimizer& o, const std::vector<std::uintptr_t>& params) {
             const auto p = pointers<float>(params);
             py::gil_scoped_release release;
             o.restore_parameters(p);
           }, py::arg("params"),
           "Copies the committed master copy into the parameters: after an OffloadError whose not_undone "
           "lists parameters, a step that failed and could not be undone.")
      .def_property_readonly("fields", &offload::offloaded_optimizer::fields)
      // Read under the optimizer's lock, which another thread's step may hold for long.
      .def_property_readonly("steps", [](const offload::offloaded_optimizer& o) {
        py::gil_scoped_release release;
        return o.steps();
      })
      .def_property_readonly("numels", &offload::offloaded_optimizer::numels)
      .def_property_readonly("initialized", [](const offload::offloaded_optimizer& o) {
        py::gil_scoped_release release;
        return o.initialized();
      })
      .def_property_readonly("simd", [](const offload::offloaded_optimizer& o) {
        return std::string(offload::to_string(o.simd()));
      })
      .def_property_readonly("groups", [](const offload::offloaded_optimizer& o) {
        py::list out;
        for (const auto& g : o.groups()) {
          py::list pieces;
          for (const auto& p : g.pieces) pieces.append(py::make_tuple(p.param, p.param_offset, p.count, p.group_offset));
          out.append(py::make_tuple(g.index, g.elements, g.stride, pieces));
        }
        return out;
      }, "Per sub-group: (index, elements, stride, [(param, param_offset, count, group_offset)]).")
      // The optimizer's lock is taken with the GIL released and the callback runs with it
      // held, so that another thread's call waits for the lock without holding the GIL.
      .def("visit", [](offload::offloaded_optimizer& o, const py::function& f, bool copy) {
             py::gil_scoped_release release;
             o.visit([&](const offload::offloaded_optimizer::group& g, const float* record) {
               call_with_record(f, o, g, const_cast<float*>(record), copy, false);
             });
           }, py::arg("callback"), py::arg("copy") = true,
           "Calls callback(group, record) for each sub-group, one record in memory at a time; record is a "
           "(fields, stride) float32 array: a copy of the committed record (copy=True: keep it if you like, "
           "changing it changes nothing), or a read-only view of the staging buffer, valid only during the "
           "call (copy=False: no copy; a RuntimeError if it or a view of it is kept). Calling the optimizer's "
           "step, visit, rewrite, save, load or initialize from the callback is a RuntimeError; other "
           "threads' calls wait until visit returns.")
      .def("rewrite", [](offload::offloaded_optimizer& o, const py::function& f, std::vector<std::uint64_t> steps,
                         bool copy) {
             py::gil_scoped_release release;
             o.rewrite([&](const offload::offloaded_optimizer::group& g, float* record) {
               call_with_record(f, o, g, record, copy, true);
             }, std::move(steps));
           }, py::arg("callback"), py::arg("steps") = std::vector<std::uint64_t>{}, py::arg("copy") = true,
           "Like visit, with a writable record: what the callback leaves in it when it returns is written "
           "(with copy=True, later changes to the array change nothing); the edited state is committed when "
           "every record is written.")
      .def("save", [](offload::offloaded_optimizer& o, const file_name& path, const py::bytes& note) {
             const std::string bytes = note;
             py::gil_scoped_release release;
             o.save(path, bytes);
           }, py::arg("path"), py::arg("note") = py::bytes(),
           "Writes the committed state and `note` (kept with it, checksummed) to `path`.")
      .def("load", [](offload::offloaded_optimizer& o, const file_name& path) {
             std::string note;
             {
               py::gil_scoped_release release;
               note = o.load(path);
             }
             return py::bytes(note);
           }, py::arg("path"), "Replaces the state with the checkpoint at `path`; returns its note.")
      .def("stage_load", [](offload::offloaded_optimizer& o, const file_name& path) {
             std::string note;
             {
               py::gil_scoped_release release;
               note = o.stage_load(path);
             }
             return py::bytes(note);
           }, py::arg("path"),
           "The first half of load: reads and checks the checkpoint into the generation not in use; the state "
           "stays as it was until commit_load. Returns its note.")
      .def("commit_load", [](offload::offloaded_optimizer& o) {
             py::gil_scoped_release release;
             o.commit_load();
           }, "Makes the staged checkpoint the state (no I/O); RuntimeError when none is staged.")
      .def("drop_staged_load", [](offload::offloaded_optimizer& o) {
             py::gil_scoped_release release;
             o.drop_staged_load();
           }, "Forgets a staged checkpoint; the state is unchanged.")
      .def("load_staged", [](offload::offloaded_optimizer& o) {
             py::gil_scoped_release release;
             return o.load_staged();
           }, "Whether a checkpoint is staged.")
      .def("stats", [](offload::offloaded_optimizer& o) {
        const offload::swap_space_stats s = o.space().stats();
        const memory::pool_stats p = o.pool().stats();
        py::dict d;
        d["bytes_read"] = s.bytes_read;
        d["bytes_written"] = s.bytes_written;
        d["folder_bytes"] = s.folder_bytes;
        d["engine"] = s.io.engine;
        d["fallback"] = s.io.fallback;
        d["synchronous_requests"] = s.io.synchronous_requests;
        d["direct_ops"] = s.io.direct_ops;
        d["buffered_ops"] = s.io.buffered_ops;
        d["pinned_slab_bytes"] = p.slab_bytes;
        d["pinned_locked_bytes"] = p.locked_bytes;
        d["pinned_peak_in_use"] = p.peak_in_use_bytes;
        d["pinned_budget"] = o.options().pipeline.pinned_budget;
        return d;
      })
      .def("paths", [](offload::offloaded_optimizer& o) {
        std::vector<file_name> out;
        for (const auto& g : o.groups()) {
          for (unsigned slot = 0; slot < 2; ++slot) {
            for (std::size_t f = 0; f < o.options().swap.folders.size(); ++f) out.push_back({o.space().path(g.tensor, slot, f)});
          }
        }
        return out;
      }, "The swap files' paths (both generations, every folder).");
}
