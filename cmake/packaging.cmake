# Installation layout and Debian packages (CPack; issue 34).
#
#   tools/package.sh            # builds build/ and the .deb files in build/packages/
#   cpack --config build/CPackConfig.cmake -B build/packages   # the same, by hand
#
# One package per component, all of one version (project(VERSION) in the
# top-level CMakeLists.txt, the one place it is set):
#   ciuicd        the daemon and ciuicctl, the systemd unit (enabled and
#                 started on install, restarted on upgrade, stopped on
#                 removal: deploy/debian/ciuicd/*), /etc/ciuic/ciuicd.yaml (a conffile)
#   libciuic0     the C++ SDK's shared library (SONAME libciuic.so.0)
#   libciuic-dev  its headers, libciuic.so, a CMake package (find_package(ciuic),
#                 target ciuic::ciuic) and a pkg-config file (pkg-config ciuic)
#   python3-ciuic the Python package `ciuic` for Debian's python3
#   ciuic-bench   the benchmark (nccl-tests format)
# Runtime dependencies come from dpkg-shlibdeps. A build with CUDA (nvcc
# found) carries the device paths (the CUDA runtime is linked statically: a
# node needs only the driver); without it, the same packages without them.
#
# Paths are relative to the package prefix, /usr, whatever CMAKE_INSTALL_PREFIX
# a developer's build has; only the configuration file's is absolute.

# A build against the CUDA emulation is for tests only: no install rules,
# no packages.
if(CIUIC_CUDA_EMULATED)
  return()
endif()

set(CIUIC_PY_INSTALL_DIR lib/python3/dist-packages/ciuic)

install(TARGETS ciuicd ciuicctl RUNTIME DESTINATION bin COMPONENT daemon)
# The unit, with the daemon where the package puts it.
file(READ ${PROJECT_SOURCE_DIR}/deploy/ciuicd.service _ciuic_unit)
string(REPLACE "/usr/local/bin/ciuicd" "/usr/bin/ciuicd" _ciuic_unit "${_ciuic_unit}")
file(WRITE ${PROJECT_BINARY_DIR}/packaging/ciuicd.service "${_ciuic_unit}")
install(FILES ${PROJECT_BINARY_DIR}/packaging/ciuicd.service
        DESTINATION lib/systemd/system COMPONENT daemon)
install(FILES ${PROJECT_SOURCE_DIR}/deploy/ciuicd.yaml DESTINATION /etc/ciuic COMPONENT daemon)

install(TARGETS ciuic EXPORT ciuicTargets
        LIBRARY DESTINATION lib COMPONENT lib NAMELINK_COMPONENT dev
        INCLUDES DESTINATION include)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/sdk/include/ciuic DESTINATION include COMPONENT dev)
install(EXPORT ciuicTargets NAMESPACE ciuic:: DESTINATION lib/cmake/ciuic COMPONENT dev)
include(CMakePackageConfigHelpers)
file(WRITE ${PROJECT_BINARY_DIR}/packaging/ciuicConfig.cmake
     "# find_package(ciuic): the imported target ciuic::ciuic (the C++ SDK).\n"
     "include(\"\${CMAKE_CURRENT_LIST_DIR}/ciuicTargets.cmake\")\n")
write_basic_package_version_file(${PROJECT_BINARY_DIR}/packaging/ciuicConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/packaging/ciuicConfig.cmake
              ${PROJECT_BINARY_DIR}/packaging/ciuicConfigVersion.cmake
        DESTINATION lib/cmake/ciuic COMPONENT dev)
# pkg-config: the package's prefix, /usr.
file(WRITE ${PROJECT_BINARY_DIR}/packaging/ciuic.pc
     "prefix=/usr\nlibdir=\${prefix}/lib\nincludedir=\${prefix}/include\n\n"
     "Name: ciuic\nDescription: C++ SDK of the ciuic per-node communication daemon\n"
     "Version: ${PROJECT_VERSION}\nLibs: -L\${libdir} -lciuic\nCflags: -I\${includedir}\n")
install(FILES ${PROJECT_BINARY_DIR}/packaging/ciuic.pc DESTINATION lib/pkgconfig COMPONENT dev)

if(TARGET _ciuic)
  install(TARGETS _ciuic LIBRARY DESTINATION ${CIUIC_PY_INSTALL_DIR} COMPONENT python)
  file(GLOB _ciuic_py ${PROJECT_SOURCE_DIR}/sdk/python/ciuic/*.py)
  install(FILES ${_ciuic_py} DESTINATION ${CIUIC_PY_INSTALL_DIR} COMPONENT python)
endif()
install(TARGETS ciuic-bench RUNTIME DESTINATION bin COMPONENT bench)

set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME ciuic)
set(CPACK_PACKAGE_VENDOR "ciuic")
set(CPACK_PACKAGE_CONTACT "ciuic developers <ciuic@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "per-node communication daemon for distributed training")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_STRIP_FILES ON)
set(CPACK_DEB_COMPONENT_INSTALL ON)
# CPACK_COMPONENT_<C>_DEPENDS become Depends: (same version).
set(CPACK_DEBIAN_ENABLE_COMPONENT_DEPENDS ON)
set(CPACK_COMPONENTS_ALL daemon lib dev bench)
if(TARGET _ciuic)
  list(APPEND CPACK_COMPONENTS_ALL python)
endif()
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION net)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
# libciuic.so.0 is found in the build tree; its packages' dependency on
# libciuic0 comes from the component dependencies below.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS ${PROJECT_BINARY_DIR}/sdk/src)

set(CPACK_DEBIAN_DAEMON_PACKAGE_NAME ciuicd)
set(CPACK_DEBIAN_DAEMON_PACKAGE_SECTION net)
set(CPACK_DEBIAN_DAEMON_PACKAGE_CONTROL_EXTRA
    ${PROJECT_SOURCE_DIR}/deploy/debian/ciuicd/conffiles
    ${PROJECT_SOURCE_DIR}/deploy/debian/ciuicd/postinst
    ${PROJECT_SOURCE_DIR}/deploy/debian/ciuicd/prerm
    ${PROJECT_SOURCE_DIR}/deploy/debian/ciuicd/postrm)
set(CPACK_DEBIAN_DAEMON_PACKAGE_CONTROL_STRICT_PERMISSION ON)
set(CPACK_COMPONENT_DAEMON_DESCRIPTION
    "ciuic daemon (ciuicd) and its control tool (ciuicctl)\n"
    "One per node, a systemd service: trainers hand it tensors through shared memory; it\n"
    "reduces across the node's trainers and exchanges data with the other nodes' daemons.")

set(CPACK_DEBIAN_LIB_PACKAGE_NAME libciuic0)
set(CPACK_DEBIAN_LIB_PACKAGE_SECTION libs)
set(CPACK_DEBIAN_LIB_PACKAGE_GENERATE_SHLIBS ON)
set(CPACK_COMPONENT_LIB_DESCRIPTION "ciuic C++ SDK (shared library)")

set(CPACK_DEBIAN_DEV_PACKAGE_NAME libciuic-dev)
set(CPACK_DEBIAN_DEV_PACKAGE_SECTION libdevel)
set(CPACK_COMPONENT_DEV_DESCRIPTION
    "ciuic C++ SDK: headers, CMake package (find_package(ciuic)) and pkg-config file")
set(CPACK_COMPONENT_DEV_DEPENDS lib)

set(CPACK_DEBIAN_PYTHON_PACKAGE_NAME python3-ciuic)
set(CPACK_DEBIAN_PYTHON_PACKAGE_SECTION python)
# The extension is built for one interpreter (Python_EXECUTABLE): that
# minor version of python3.
find_package(Python COMPONENTS Interpreter QUIET)
math(EXPR _ciuic_py_next "${Python_VERSION_MINOR} + 1")
set(CPACK_DEBIAN_PYTHON_PACKAGE_DEPENDS
    "python3 (>= ${Python_VERSION_MAJOR}.${Python_VERSION_MINOR}), python3 (<< ${Python_VERSION_MAJOR}.${_ciuic_py_next}), python3-numpy")
set(CPACK_COMPONENT_PYTHON_DESCRIPTION "ciuic Python SDK (import ciuic), with the PyTorch hooks")
set(CPACK_COMPONENT_PYTHON_DEPENDS lib)
set(CPACK_DEBIAN_PYTHON_PACKAGE_CONTROL_EXTRA
    ${PROJECT_SOURCE_DIR}/deploy/debian/python3-ciuic/postinst
    ${PROJECT_SOURCE_DIR}/deploy/debian/python3-ciuic/prerm)
set(CPACK_DEBIAN_PYTHON_PACKAGE_CONTROL_STRICT_PERMISSION ON)

set(CPACK_DEBIAN_BENCH_PACKAGE_NAME ciuic-bench)
set(CPACK_COMPONENT_BENCH_DESCRIPTION "ciuic benchmark (nccl-tests format)")
set(CPACK_COMPONENT_BENCH_DEPENDS daemon)

include(CPack)
