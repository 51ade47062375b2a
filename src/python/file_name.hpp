#pragma once
// File names and messages between Python and the library.
//
// A file name on Linux is bytes. Python hands one over as str (its bytes that are not UTF-8
// held as lone surrogates, as os.listdir and os.fsdecode make them), as bytes, or as an
// os.PathLike (pathlib.Path). `file_name` takes all three and gives the library the bytes
// os.fsencode gives; back in Python a name is a str made as os.fsdecode makes it, so a name
// read from a result opens the same file again.
//
// A message may hold such a name: `message_text` makes it a str whatever its bytes, each
// byte that is not UTF-8 written \xNN (a message is read, not opened).

#include <pybind11/pybind11.h>

#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

namespace tensormem::python {

struct file_name {
  std::string bytes;
  operator const std::string&() const noexcept { return bytes; }  // NOLINT(google-explicit-constructor)
};

/// A text that stands beside file names and is compared with their bytes (a swap file's
/// identity key, the path's bytes by default): str or bytes, converted as a file name is,
/// so that a key given as the str of a name equals that name's default key.
struct name_text : file_name {};

/// The bytes of each name, in order.
template <class Name>
std::vector<std::string> name_bytes(const std::vector<Name>& names) {
  std::vector<std::string> out;
  out.reserve(names.size());
  for (const file_name& n : names) out.push_back(n.bytes);
  return out;
}

/// `name` as os.fsdecode makes it.
inline pybind11::str python_file_name(const std::string& name) {
  PyObject* s = PyUnicode_DecodeFSDefaultAndSize(name.data(), static_cast<Py_ssize_t>(name.size()));
  if (s == nullptr) throw pybind11::error_already_set();
  return pybind11::reinterpret_steal<pybind11::str>(s);
}

/// `text` as a str: UTF-8, each byte that is not written \xNN.
inline pybind11::str message_text(const char* text, std::size_t bytes) {
  PyObject* s = PyUnicode_DecodeUTF8(text, static_cast<Py_ssize_t>(bytes), "backslashreplace");
  if (s == nullptr) throw pybind11::error_already_set();
  return pybind11::reinterpret_steal<pybind11::str>(s);
}
inline pybind11::str message_text(const std::string& text) { return message_text(text.data(), text.size()); }

/// Sets the Python error `type` with the message `what` (whatever its bytes).
inline void set_python_error(PyObject* type, const char* what) {
  PyObject* s = PyUnicode_DecodeUTF8(what, static_cast<Py_ssize_t>(std::strlen(what)), "backslashreplace");
  if (s == nullptr) return;  // the decoding's own error (memory) stays set
  PyErr_SetObject(type, s);
  Py_DECREF(s);
}

/// The Python class pybind11 gives a standard exception of `e`'s class.
inline PyObject* python_class_of(const std::exception& e) {
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) return PyExc_MemoryError;
  if (dynamic_cast<const std::out_of_range*>(&e) != nullptr) return PyExc_IndexError;
  if (dynamic_cast<const std::overflow_error*>(&e) != nullptr) return PyExc_OverflowError;
  if (dynamic_cast<const std::domain_error*>(&e) != nullptr || dynamic_cast<const std::invalid_argument*>(&e) != nullptr ||
      dynamic_cast<const std::length_error*>(&e) != nullptr || dynamic_cast<const std::range_error*>(&e) != nullptr) {
    return PyExc_ValueError;
  }
  return PyExc_RuntimeError;
}

}  // namespace tensormem::python

namespace pybind11::detail {

/// Loads a str or bytes (and, with `path_like`, an os.PathLike) as os.fsencode does.
inline bool load_name_bytes(handle source, bool path_like, std::string& out) {
  PyObject* o = source.ptr();
  if (o == nullptr ||
      !(PyUnicode_Check(o) || PyBytes_Check(o) || (path_like && PyObject_HasAttrString(o, "__fspath__")))) {
    return false;
  }
  const object path = reinterpret_steal<object>(PyOS_FSPath(o));  // str or bytes
  if (!path) throw error_already_set();                             // __fspath__ raised or returned neither
  object encoded = path;
  if (PyUnicode_Check(path.ptr())) {
    encoded = reinterpret_steal<object>(PyUnicode_EncodeFSDefault(path.ptr()));
    if (!encoded) throw error_already_set();  // a surrogate that no byte stands for
  }
  out.assign(PyBytes_AS_STRING(encoded.ptr()), static_cast<std::size_t>(PyBytes_GET_SIZE(encoded.ptr())));
  return true;
}

template <>
struct type_caster<tensormem::python::name_text> {
  PYBIND11_TYPE_CASTER(tensormem::python::name_text, const_name("Union[str, bytes]"));
  bool load(handle source, bool /*convert*/) { return load_name_bytes(source, false, value.bytes); }
  static handle cast(const tensormem::python::name_text& text, return_value_policy /*policy*/, handle /*parent*/) {
    return tensormem::python::python_file_name(text.bytes).release();
  }
};

template <>
struct type_caster<tensormem::python::file_name> {
  PYBIND11_TYPE_CASTER(tensormem::python::file_name, const_name("Union[str, bytes, os.PathLike]"));

  bool load(handle source, bool /*convert*/) { return load_name_bytes(source, true, value.bytes); }

  static handle cast(const tensormem::python::file_name& name, return_value_policy /*policy*/, handle /*parent*/) {
    return tensormem::python::python_file_name(name.bytes).release();
  }
};

}  // namespace pybind11::detail
