// verl_mega._kernels: Python bindings of the CPU kernels (signatures shared with verl_mega._kernels_cuda,
// RMSNorm's excepted, and with the reference in verl_mega/ops/fallback.py).
#include <torch/csrc/utils/pybind.h>

#include "cpu_kernels.h"

PYBIND11_MODULE(_kernels, m) {
  namespace py = pybind11;
  m.doc() = "CPU kernels for verl_mega.ops: vocabulary-slice log-prob partials, their backward, masked GAE, RMSNorm";
  m.def("logprob_partials", &verl_mega::logprob_partials, py::arg("logits"), py::arg("labels"),
        py::arg("vocab_start"), py::arg("with_entropy"), py::call_guard<py::gil_scoped_release>());
  m.def("logprob_backward", &verl_mega::logprob_backward, py::arg("logits"), py::arg("labels"),
        py::arg("vocab_start"), py::arg("log_normalizer"), py::arg("grad_logprob"), py::arg("mean_logit"),
        py::arg("grad_entropy"), py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm_forward", &verl_mega::rms_norm_forward, py::arg("x"), py::arg("weight"), py::arg("eps"),
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm_backward", &verl_mega::rms_norm_backward, py::arg("grad_y"), py::arg("x"), py::arg("weight"),
        py::arg("rstd"), py::call_guard<py::gil_scoped_release>());
  m.def("gae", &verl_mega::gae, py::arg("rewards"), py::arg("values"), py::arg("mask"), py::arg("gamma"),
        py::arg("lam"), py::call_guard<py::gil_scoped_release>());
}
