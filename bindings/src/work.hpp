// tierflow._core.Work: the completion of something running off the
// caller's thread — a collective, or a Lease.copy_into read — and the
// buffers it uses, kept alive until it is done.
#pragma once

#include "arrays.hpp"
#include "communicators.hpp"

namespace tierflow::python {

// Over CPU buffers: a Gloo collective's, or a Lease.copy_into's.
using py_work = basic_work<const_buffer, buffer>;

}  // namespace tierflow::python
