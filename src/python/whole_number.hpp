#pragma once
// Arguments that are sizes, counts, offsets, alignments or ids: a Python integer (or any
// object with __index__, such as a numpy integer) from 0 to the largest value of T.
//
// pybind11's own conversion of an unsigned parameter answers -1 or 2**64 with "incompatible
// function arguments", a TypeError that lists the signature, as if the value were of the
// wrong type. `whole<T>` says what is wrong instead: ValueError "expected a whole number
// from 0 to 18446744073709551615, not -1". Floats and bools stay a TypeError (a size of 2.5
// or True is a mistake of type, not of range).

#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <string>

namespace tensormem::python {

template <class T>
struct whole {
  static_assert(std::numeric_limits<T>::is_integer && !std::numeric_limits<T>::is_signed);
  T value{};
  operator T() const noexcept { return value; }  // NOLINT(google-explicit-constructor): used as T
};

using u64 = whole<std::uint64_t>;

}  // namespace tensormem::python

namespace pybind11::detail {

template <class T>
struct type_caster<tensormem::python::whole<T>> {
  PYBIND11_TYPE_CASTER(tensormem::python::whole<T>, const_name("int"));

  bool load(handle source, bool /*convert*/) {
    PyObject* o = source.ptr();
    if (o == nullptr || PyBool_Check(o) || PyFloat_Check(o) || PyIndex_Check(o) == 0) return false;
    const object number = reinterpret_steal<object>(PyNumber_Index(o));
    if (!number) {
      PyErr_Clear();
      return false;
    }
    const unsigned long long v = PyLong_AsUnsignedLongLong(number.ptr());  // NOLINT(google-runtime-int)
    const bool failed = v == static_cast<unsigned long long>(-1) && PyErr_Occurred() != nullptr;  // NOLINT
    if (failed) PyErr_Clear();
    if (failed || v > std::numeric_limits<T>::max()) {
      throw value_error("expected a whole number from 0 to " + std::to_string(std::numeric_limits<T>::max()) +
                        ", not " + std::string(str(number)).substr(0, 60));
    }
    value.value = static_cast<T>(v);
    return true;
  }

  static handle cast(const tensormem::python::whole<T>& v, return_value_policy /*policy*/, handle /*parent*/) {
    return PyLong_FromUnsignedLongLong(v.value);
  }
};

}  // namespace pybind11::detail
