#include "control/testing/test_certs.h"

#include <stdlib.h>

#include <cstdio>
#include <filesystem>

namespace ciuic::testing {
namespace {

// Runs `command` in `dir` (its output into dir/openssl.log); true on exit 0.
bool Run(const std::string& dir, const std::string& command) {
  const std::string line = "cd '" + dir + "' && " + command + " >>openssl.log 2>&1";
  return std::system(line.c_str()) == 0;
}

constexpr const char* kNewKey =
    "openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";

bool MakeCa(const std::string& dir, const std::string& name) {
  return Run(dir, std::string(kNewKey) + " -x509 -days 2 -subj /CN=" + name + " -keyout " + name +
                      ".key -out " + name + ".pem");
}

bool MakeNode(const std::string& dir, const std::string& node, const std::string& ca) {
  return Run(dir, std::string(kNewKey) + " -subj /CN=" + node + " -keyout " + node + ".key -out " +
                      node + ".csr") &&
         Run(dir, "openssl x509 -req -days 2 -in " + node + ".csr -CA " + ca + ".pem -CAkey " + ca +
                      ".key -CAcreateserial -out " + node + ".pem");
}

}  // namespace

std::unique_ptr<TestCerts> TestCerts::Make(const std::vector<std::string>& nodes,
                                           std::string* error) {
  char tmpl[] = "/tmp/ciuic-certs-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    *error = "mkdtemp failed";
    return nullptr;
  }
  std::unique_ptr<TestCerts> certs(new TestCerts(tmpl));
  bool ok = MakeCa(tmpl, "ca") && MakeCa(tmpl, "other-ca") && MakeNode(tmpl, "rogue", "other-ca");
  for (const std::string& node : nodes) ok = ok && MakeNode(tmpl, node, "ca");
  if (!ok) {
    *error = "openssl failed; see " + certs->dir_ + "/openssl.log";
    certs->dir_.clear();  // kept for the reader
    return nullptr;
  }
  return certs;
}

TestCerts::~TestCerts() {
  std::error_code ignored;
  if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
}

std::string TestCerts::ConfigOf(const std::string& node) const {
  return "tls_cert_file: " + cert(node) + "\ntls_key_file: " + key(node) +
         "\ntls_ca_file: " + ca() + "\n";
}

}  // namespace ciuic::testing
