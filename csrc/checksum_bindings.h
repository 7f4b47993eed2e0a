// The module-level Python functions of vllm_pd._C (see checksum_bindings.cpp).
#pragma once

#include <Python.h>

PyMethodDef* vllm_pd_checksum_methods();
