// Serve a model transformed by fxrec from C++ (libtorch), both ways C++ servers load PyTorch models:
//
//   fxrec_infer [--device DEV] MODEL.pt  INPUTS.pt OUTPUTS.pt [LIB.so ...]   TorchScript (fxrec.export.torchscript)
//   fxrec_infer [--device DEV] MODEL.pt2 INPUTS.pt OUTPUTS.pt [LIB.so ...]   AOTInductor package (fxrec.export.aoti)
//
// --device (default cpu; e.g. cuda, cuda:1): where the model runs. A TorchScript model is loaded
// onto it, the inputs are moved to it, and the outputs are written from the CPU. Script (or
// compile) the model on the device it will serve on: fxrec packs quantized rows for a device,
// and refuses a CPU packing on CUDA. An AOTInductor package runs where it was compiled for; its
// inputs go to DEV.
//
// LIB.so: fbgemm_gpu's operator libraries, loaded first (in the order given) so that the
// model's fbgemm operators resolve; fxrec.export.fbgemm_libraries() lists them.
// INPUTS.pt: the model's positional arguments as one tuple, written by Python's torch.save
// (tensors, lists of tensors, str-keyed dicts of tensors). OUTPUTS.pt: what forward returned,
// written with torch::pickle_save, which Python's torch.load reads. An AOTInductor package takes
// the input tensors flattened in pytree order (lists in order, dicts in key order) and returns
// its output tensors as a flat tuple. It checks each input's dtype, device and sizes before it
// runs (AOTInductor's checks, which this program turns on: AOTI_RUNTIME_CHECK_INPUTS=1 unless the
// environment sets it), and an error names the input from the package's metadata.
#include <dlfcn.h>

#include <cstdlib>
#include <sstream>

#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/script.h>
#include <torch/serialize.h>

static std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Unpickled containers are generic (List[Any], Dict[Any, Any]); TorchScript's forward wants
// them typed (List[Tensor], Dict[str, Tensor], nested lists of those).
static c10::IValue typed(const c10::IValue& v) {
  if (v.isList()) {
    auto items = v.toList();
    bool all_tensors = true;
    for (const c10::IValue& x : items) all_tensors = all_tensors && x.isTensor();
    if (all_tensors) {
      c10::List<at::Tensor> out;
      for (const c10::IValue& x : items) out.push_back(x.toTensor());
      return out;
    }
    c10::impl::GenericList out(c10::AnyType::get());
    std::vector<c10::IValue> elems;
    for (const c10::IValue& x : items) elems.push_back(typed(x));
    if (!elems.empty()) {
      out = c10::impl::GenericList(elems[0].type());
      for (auto& e : elems) out.push_back(e);
    }
    return out;
  }
  if (v.isGenericDict()) {
    c10::Dict<std::string, at::Tensor> out;
    for (const auto& kv : v.toGenericDict()) out.insert(kv.key().toStringRef(), kv.value().toTensor());
    return out;
  }
  if (v.isTuple()) {
    std::vector<c10::IValue> elems;
    for (const c10::IValue& x : v.toTupleRef().elements()) elems.push_back(typed(x));
    return c10::ivalue::Tuple::create(std::move(elems));
  }
  return v;
}

// ``v`` with every tensor in it moved to ``device`` (containers keep their types).
static c10::IValue to_device(const c10::IValue& v, const c10::Device& device) {
  if (v.isTensor()) return v.toTensor().to(device);
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) out.push_back(t.to(device));
    return out;
  }
  if (v.isList()) {
    auto items = v.toList();
    c10::impl::GenericList out(items.elementType());
    for (const c10::IValue& x : items) out.push_back(to_device(x, device));
    return out;
  }
  if (v.isGenericDict()) {
    auto dict = v.toGenericDict();
    c10::impl::GenericDict out(dict.keyType(), dict.valueType());
    for (const auto& kv : dict) out.insert(kv.key(), to_device(kv.value(), device));
    return out;
  }
  if (v.isTuple()) {
    std::vector<c10::IValue> elems;
    for (const c10::IValue& x : v.toTupleRef().elements()) elems.push_back(to_device(x, device));
    return c10::ivalue::Tuple::create(std::move(elems));
  }
  return v;
}

// The tensors of an input, in pytree order.
static void flatten(const c10::IValue& v, std::vector<at::Tensor>& out) {
  if (v.isTensor()) {
    out.push_back(v.toTensor());
  } else if (v.isList()) {
    for (const c10::IValue& x : v.toList()) flatten(x, out);
  } else if (v.isTuple()) {
    for (const c10::IValue& x : v.toTupleRef().elements()) flatten(x, out);
  } else if (v.isGenericDict()) {
    for (const auto& kv : v.toGenericDict()) flatten(kv.value(), out);
  } else if (!v.isNone()) {
    throw std::runtime_error("inputs may hold only tensors, lists, tuples and dicts of them");
  }
}

// An AOTInductor package's error names an input by its index ("input_handles[3]"); fxrec.export.aoti
// writes each input's name on a line of the package's metadata "fxrec_inputs". The message with
// the index replaced by the name; where the message does not say which input (torch 2.11's loader
// says only that "run_func_" failed, and prints the reason to stderr), with the names listed.
// Other messages are left as they are.
static std::string named_inputs(std::string what, const std::string& names) {
  std::vector<std::string> lines;
  std::istringstream in(names);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  const std::string key = "input_handles[";
  const size_t at = what.find(key);
  const size_t end = at == std::string::npos ? at : what.find(']', at);
  if (end != std::string::npos) {
    const std::string index = what.substr(at + key.size(), end - at - key.size());
    if (!index.empty() && index.size() < 10 && index.find_first_not_of("0123456789") == std::string::npos) {
      const size_t k = std::stoul(index);
      if (k < lines.size()) return what.replace(at, end + 1 - at, lines[k]);
    }
    return what;
  }
  if (what.find("run_func_") == std::string::npos || lines.empty()) return what;
  what += " (the package's inputs, by index:";
  for (size_t k = 0; k < lines.size(); ++k) what += " [" + std::to_string(k) + "] " + lines[k] + (k + 1 < lines.size() ? ";" : ")");
  return what;
}

static bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

int main(int argc, char** argv) {
  setenv("AOTI_RUNTIME_CHECK_INPUTS", "1", /*overwrite=*/0);  // read by a package at its first call
  std::string device_name = "cpu";
  if (argc >= 3 && std::string(argv[1]) == "--device") {
    device_name = argv[2];
    argv[2] = argv[0];
    argv += 2;
    argc -= 2;
  }
  if (argc < 4) {
    std::cerr << "usage: " << argv[0] << " [--device DEV] MODEL.pt INPUTS.pt OUTPUTS.pt [LIB.so ...]\n";
    return 2;
  }
  for (int i = 4; i < argc; ++i) {
    if (!dlopen(argv[i], RTLD_NOW | RTLD_GLOBAL)) {
      std::cerr << "cannot load " << argv[i] << ": " << dlerror() << "\n";
      return 1;
    }
  }
  c10::Device device(c10::kCPU);
  try {
    device = c10::Device(device_name);
  } catch (const c10::Error& e) {
    std::cerr << "fxrec_infer: --device " << device_name << " is not a device: " << e.what_without_backtrace() << "\n";
    return 2;
  }
  try {
    c10::IValue inputs = torch::pickle_load(read_file(argv[2]));
    if (!inputs.isTuple()) throw std::runtime_error("INPUTS.pt must hold a tuple of the model's arguments");
    inputs = to_device(inputs, device);
    const c10::Device cpu(c10::kCPU);
    if (ends_with(argv[1], ".pt2")) {
      torch::inductor::AOTIModelPackageLoader loader(argv[1]);
      std::vector<at::Tensor> flat;
      flatten(inputs, flat);
      std::vector<at::Tensor> outs;
      try {
        c10::InferenceMode guard;
        outs = loader.run(flat);
      } catch (const std::exception& e) {
        const auto* error = dynamic_cast<const c10::Error*>(&e);
        std::string what = error ? error->what_without_backtrace() : e.what();
        try {
          const auto metadata = loader.get_metadata();
          const auto names = metadata.find("fxrec_inputs");
          if (names != metadata.end()) what = named_inputs(what, names->second);
        } catch (const std::exception&) {  // (no metadata to read: the message as it is)
        }
        throw std::runtime_error(what);
      }
      std::vector<c10::IValue> elems;
      for (const at::Tensor& t : outs) elems.push_back(t.to(cpu));
      std::vector<char> bytes = torch::pickle_save(c10::ivalue::Tuple::create(std::move(elems)));
      std::ofstream(argv[3], std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
      return 0;
    }
    torch::jit::script::Module model = torch::jit::load(argv[1], device);
    model.eval();
    std::vector<c10::IValue> args;
    for (const c10::IValue& x : inputs.toTupleRef().elements()) args.push_back(typed(x));
    c10::IValue out;
    {
      c10::InferenceMode guard;
      out = model.forward(args);
    }
    std::vector<char> bytes = torch::pickle_save(to_device(out, cpu));
    std::ofstream(argv[3], std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  } catch (const std::exception& e) {
    std::cerr << "fxrec_infer: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
