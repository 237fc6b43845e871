// Certificates for TLS tests, made at run time in a temp dir with the
// `openssl` command (no key is ever committed): a cluster CA, a certificate
// it signs for each named node, and "rogue", a node certificate signed by
// another CA. Any thread; Make blocks for a few hundred milliseconds.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace ciuic::testing {

class TestCerts {
 public:
  // nullptr (and *error says why) when `openssl` is missing or fails.
  static std::unique_ptr<TestCerts> Make(const std::vector<std::string>& nodes, std::string* error);
  ~TestCerts();  // removes the directory

  const std::string& dir() const { return dir_; }
  std::string ca() const { return dir_ + "/ca.pem"; }
  std::string cert(const std::string& node) const { return dir_ + "/" + node + ".pem"; }
  std::string key(const std::string& node) const { return dir_ + "/" + node + ".key"; }
  // The three config lines of `node` (tls_cert_file, tls_key_file,
  // tls_ca_file), "rogue" included (with the cluster CA as its tls_ca_file).
  std::string ConfigOf(const std::string& node) const;

 private:
  explicit TestCerts(std::string dir) : dir_(std::move(dir)) {}
  std::string dir_;
};

}  // namespace ciuic::testing
